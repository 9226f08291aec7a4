"""Models shipped inside the package, resolved by name (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.tinyloop"))


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """An existing path is used as is; otherwise the name of a built-in model; else a ValueError."""
    path = Path(name_or_path)
    if path.exists():
        if path.is_dir():
            raise ValueError(f"{path} is a directory, expected a .tinyloop file")
        return path
    text = str(name_or_path)
    candidate = BUILTIN_DIR / f"{text}.tinyloop"
    if os.sep not in text and "/" not in text and candidate.is_file():
        return candidate
    names = builtin_names()
    available = ", ".join(names) if names else "none installed"
    raise ValueError(f"no model file {text!r} and no built-in model of that name (built-in models: {available})")
