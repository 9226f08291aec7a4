"""Finding what the tests need outside the checkout: a clear failure on CI, a visible skip elsewhere.

The shared data (spec, reference vectors) lives in `../shared` next to the checkout. When it, or anything
else CI installs (triton), is missing, a test fails if the environment variable CI is set (true, 1, yes...),
and skips naming what is missing otherwise.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

REPO = Path(__file__).absolute().parent.parent
SHARED = REPO.parent / "shared"


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(what: str) -> NoReturn:
    """Fail on CI (a test that cannot run there is a broken setup), else skip with `what` as the reason."""
    if on_ci():
        pytest.fail(f"{what} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(what, allow_module_level=True)


def shared_path(*parts: str, root: Path = SHARED) -> Path:
    """`root / parts` (root: `<repo>/../shared`); unavailable() when it does not exist."""
    path = root.joinpath(*parts)
    if not path.exists():
        unavailable(f"shared data {path} is missing (expected `shared/` next to the checkout {REPO})")
    return path


def require_module(name: str) -> ModuleType:
    """The imported module; unavailable() when it is not installed (CI installs the dev extras)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        unavailable(f"{name} is not importable ({exc}); install the dev extras: pip install -e '.[dev]'")
