"""Shared test helpers: random weights for any config, relative errors."""

from __future__ import annotations

import torch

from tinyloop.config import ArchConfig
from tinyloop.layout import model_specs


def random_flat_weights(cfg: ArchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for spec in model_specs(cfg):
        if spec.role == "vector":
            if spec.name.endswith(".weight") and "norm" in spec.name:
                t = 1.0 + 0.1 * torch.randn(spec.shape, generator=gen)
            else:
                t = 0.1 * torch.randn(spec.shape, generator=gen)
        else:
            t = 0.5 * torch.randn(spec.shape, generator=gen) / spec.shape[-1] ** 0.5
        out[spec.name] = t
    return out


def max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def frob_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())
