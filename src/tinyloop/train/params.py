"""Trainable parameters keyed by canonical tensor names: init and container (files: convert/weight_shards.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from tinyloop.config import ArchConfig
from tinyloop.layout import model_specs

_RESIDUAL_OUT = ("attn.out.weight", "mlp.down.weight")


def init_tensors(cfg: ArchConfig, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Normal(0, std) matrices; residual output projections scaled by 1/sqrt(2 * effective depth),
    where effective depth counts the body once per default loop; norm weights 1, biases 0."""
    gen = torch.Generator().manual_seed(seed)
    depth = cfg.n_prelude + cfg.n_coda + cfg.n_body * cfg.default_loops
    out: dict[str, torch.Tensor] = {}
    for spec in model_specs(cfg):
        if spec.role == "vector":
            is_norm_weight = "norm" in spec.name and spec.name.endswith(".weight")
            out[spec.name] = torch.ones(spec.shape) if is_norm_weight else torch.zeros(spec.shape)
            continue
        scale = std / math.sqrt(2 * depth) if spec.name.endswith(_RESIDUAL_OUT) else std
        out[spec.name] = torch.randn(spec.shape, generator=gen) * scale
    return out


def _key(name: str) -> str:
    # nn.ParameterDict forbids dots in keys.
    return name.replace(".", "__")


class Params(nn.Module):
    """Float32 parameters in canonical order; `flat()` gives the name -> Parameter map the model reads."""

    def __init__(self, cfg: ArchConfig, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        self.names = [s.name for s in model_specs(cfg)]
        missing = [n for n in self.names if n not in tensors]
        extra = sorted(set(tensors) - set(self.names))
        if missing or extra:
            raise ValueError(f"weights do not match config {cfg.name!r}: missing {missing[:6]}, unexpected {extra[:6]}")
        for spec in model_specs(cfg):
            if tuple(tensors[spec.name].shape) != spec.shape:
                raise ValueError(f"{spec.name}: expected shape {spec.shape}, found {tuple(tensors[spec.name].shape)}")
        self.store = nn.ParameterDict(
            {_key(n): nn.Parameter(tensors[n].detach().to(torch.float32).clone()) for n in self.names}
        )

    def flat(self) -> dict[str, torch.Tensor]:
        return {n: self.store[_key(n)] for n in self.names}

    def ordered(self) -> list[nn.Parameter]:
        return [self.store[_key(n)] for n in self.names]

    def detached(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", dtype).contiguous() for n, p in self.flat().items()}
