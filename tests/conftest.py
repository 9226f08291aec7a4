"""Fixtures: small model files written once per test session. Markers `interpret`, `slow`: tests/suite_markers.py."""

from __future__ import annotations

import os
from pathlib import Path

# The Triton kernels run in Triton's CPU interpreter here (must be set before any kernel is defined).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from helpers import random_flat_weights
from suite_markers import add_markers
from tinyloop.presets import preset


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    add_markers(items)


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tinyloop.format.writer import write_model

    cfg = preset("test-tiny")
    flat = random_flat_weights(cfg, seed=7)
    root = tmp_path_factory.mktemp("models")
    files = {}
    for name, kwargs in {
        "f32": dict(bits=16, float_dtype="F32"),
        "f16": dict(bits=16, float_dtype="F16"),
        "int8": dict(bits=8),
        "int4": dict(bits=4, group_size=32),
    }.items():
        files[name] = root / f"test-tiny-{name}.tinyloop"
        write_model(files[name], cfg, flat, progress=False, **kwargs)  # type: ignore[arg-type]
    return files
