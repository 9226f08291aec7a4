"""Fixtures for the cross-iteration rounding tests: a test-tiny INT4 file, its float weights, channel files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinyloop.config import ArchConfig
from tinyloop.convert.add_channels import add_rounding_channels
from tinyloop.convert.random_model import random_weights
from tinyloop.format.writer import write_model
from tinyloop.presets import preset


@pytest.fixture(scope="session")
def cfg() -> ArchConfig:
    return preset("test-tiny")


@pytest.fixture(scope="session")
def floats(cfg: ArchConfig) -> dict[str, torch.Tensor]:
    return random_weights(cfg, seed=3)


@pytest.fixture(scope="session")
def files(
    tmp_path_factory: pytest.TempPathFactory, cfg: ArchConfig, floats: dict[str, torch.Tensor]
) -> dict[str, Path]:
    """'int4': plain INT4 g64; 'ckpt': the float weights as a .pt; 'sign' / 'frac4': with channels."""
    root = tmp_path_factory.mktemp("stoch")
    out = {"int4": root / "int4.tinyloop", "ckpt": root / "float.pt"}
    write_model(out["int4"], cfg, floats, bits=4, group_size=64, progress=False)
    torch.save(floats, out["ckpt"])
    for bits, kind in ((1, "sign"), (4, "frac4")):
        out[kind] = root / f"{kind}.tinyloop"
        add_rounding_channels(out["int4"], out[kind], out["ckpt"], bits, progress=False)
    return out
