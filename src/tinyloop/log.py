"""Runtime messages to stderr, filtered by TINYLOOP_LOG_LEVEL (errors always print)."""

from __future__ import annotations

import sys

from tinyloop.env import log_level


def info(message: str) -> None:
    """Level 1 and up: model header, memory summary."""
    if log_level() >= 1:
        print(f"[tinyloop] {message}", file=sys.stderr, flush=True)


def detail(message: str) -> None:
    """Level 2: per-component loading, buffer allocation notes."""
    if log_level() >= 2:
        print(f"[tinyloop] {message}", file=sys.stderr, flush=True)
