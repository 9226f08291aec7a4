"""Offline jobs over datasets: per-row tasks (tasks.py) and the resumable local job (local.py); Ray runs
the same tasks through tinyloop.integrations.ray."""

from tinyloop.jobs.tasks import TASKS, JobSettings, RowError, TaskRunner, output_schema

__all__ = ["TASKS", "JobSettings", "RowError", "TaskRunner", "output_schema"]
