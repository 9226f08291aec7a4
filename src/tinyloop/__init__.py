"""TinyLoop: a runtime for looped (recurrent-depth) transformers.

Names load lazily so that torch-free tools (`tinyloop FILE inspect`) start fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Model": "tinyloop.api.model",
    "load": "tinyloop.api.model",
    "ArchConfig": "tinyloop.config",
    "Grammar": "tinyloop.grammar",
    "TinyLoopFormatError": "tinyloop.errors",
    "builtin_names": "tinyloop.builtin",
    "PrefixCache": "tinyloop.api.handles",
    "ResumeHandle": "tinyloop.api.handles",
    "PrefixPool": "tinyloop.cache.pool",
    "Scheduler": "tinyloop.api.scheduler",
    "RequestHandle": "tinyloop.runtime.requests",
    "QueueFullError": "tinyloop.errors",
    "NonFiniteLogitsError": "tinyloop.errors",
    "SamplingParams": "tinyloop.sampling",
}

__all__ = [
    "ArchConfig", "Grammar", "Model", "NonFiniteLogitsError", "PrefixCache", "PrefixPool", "QueueFullError",
    "RequestHandle", "ResumeHandle", "SamplingParams", "Scheduler", "TinyLoopFormatError", "builtin_names", "load",
]  # fmt: skip

if TYPE_CHECKING:
    from tinyloop.api.handles import PrefixCache, ResumeHandle
    from tinyloop.api.model import Model, load
    from tinyloop.api.scheduler import Scheduler
    from tinyloop.builtin import builtin_names
    from tinyloop.cache.pool import PrefixPool
    from tinyloop.config import ArchConfig
    from tinyloop.errors import NonFiniteLogitsError, QueueFullError, TinyLoopFormatError
    from tinyloop.grammar import Grammar
    from tinyloop.runtime.requests import RequestHandle
    from tinyloop.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tinyloop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
