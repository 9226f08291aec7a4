"""Deterministic random weights for any config (tests, benchmarks, `tinyloop-convert --random`)."""

from __future__ import annotations

import math
import os
import zlib

import torch

from tinyloop.config import ArchConfig
from tinyloop.format.header import ModelHeader
from tinyloop.format.writer import write_model
from tinyloop.layout import TensorSpec, model_specs

INIT_STD = 0.02
_RESIDUAL_OUTPUTS = (".attn.out.weight", ".mlp.down.weight")


def _init(spec: TensorSpec, cfg: ArchConfig, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.role != "vector":
        std = INIT_STD
        if spec.name.endswith(_RESIDUAL_OUTPUTS):
            # GPT-2 style: projections that add into the residual stream shrink with depth.
            depth = cfg.n_prelude + cfg.default_loops * cfg.n_body + cfg.n_coda
            std /= math.sqrt(2 * depth)
        return noise.mul_(std)
    if "norm" in spec.name and spec.name.endswith(".weight"):
        return noise.mul_(0.02).add_(1.0)
    # Biases and the exit gate: small but non-zero, so tests do not run on zeros.
    return noise.mul_(0.02)


def random_weights(cfg: ArchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """FP32 weights keyed by layout name; each tensor depends only on (seed, its name, its shape)."""
    gen = torch.Generator()
    out: dict[str, torch.Tensor] = {}
    for spec in model_specs(cfg):
        gen.manual_seed((seed * 0x9E3779B1 + zlib.crc32(spec.name.encode())) % (1 << 63))
        out[spec.name] = _init(spec, cfg, gen)
    return out


def write_random_model(
    path: str | os.PathLike[str],
    cfg: ArchConfig,
    seed: int = 0,
    bits: int = 16,
    group_size: int | None = 64,
    float_dtype: str = "F16",
    progress: bool = True,
) -> ModelHeader:
    return write_model(path, cfg, random_weights(cfg, seed), bits, group_size, float_dtype, progress)
