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
    "TinyLoopFormatError": "tinyloop.errors",
    "builtin_names": "tinyloop.builtin",
}

__all__ = ["ArchConfig", "Model", "TinyLoopFormatError", "builtin_names", "load"]

if TYPE_CHECKING:
    from tinyloop.api.model import Model, load
    from tinyloop.builtin import builtin_names
    from tinyloop.config import ArchConfig
    from tinyloop.errors import TinyLoopFormatError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tinyloop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
