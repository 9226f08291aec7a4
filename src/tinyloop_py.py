"""The reference documents' import name: `import tinyloop_py as tl` gives the same API as `tinyloop`."""

from __future__ import annotations

from typing import Any

import tinyloop
from tinyloop import __all__, __version__  # noqa: F401


def __getattr__(name: str) -> Any:
    return getattr(tinyloop, name)
