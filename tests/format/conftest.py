"""Shared fixtures for the format tests: a tiny config, its weights, and reference files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tinyloop.config import ArchConfig
from tinyloop.convert.random_model import random_weights
from tinyloop.format.writer import write_model
from tinyloop.presets import preset


@pytest.fixture(scope="session")
def tiny_cfg() -> ArchConfig:
    return preset("test-tiny")


@pytest.fixture(scope="session")
def tiny_weights(tiny_cfg: ArchConfig) -> dict[str, torch.Tensor]:
    return random_weights(tiny_cfg, seed=1)


@pytest.fixture(scope="session")
def format_files(
    tmp_path_factory: pytest.TempPathFactory, tiny_cfg: ArchConfig, tiny_weights: dict[str, torch.Tensor]
) -> dict[str, Path]:
    """Reference files, written once per session; tests copy them before changing anything."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for key, bits, gs in (("16", 16, None), ("8", 8, None), ("4", 4, 64)):
        out[key] = root / f"tiny{key}.tinyloop"
        write_model(out[key], tiny_cfg, tiny_weights, bits=bits, group_size=gs, progress=False)
    return out


@pytest.fixture
def copy_of(format_files: dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    def make(key: str) -> Path:
        dst = tmp_path / f"copy{key}.tinyloop"
        dst.write_bytes(format_files[key].read_bytes())
        return dst

    return make
