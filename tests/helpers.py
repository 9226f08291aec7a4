"""Shared test helpers: random weights for any config, relative errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def interpreter_policy(**choices: object) -> object:
    """A KernelPolicy for Triton's CPU interpreter, which runs each program separately: few, large plain-GEMV
    tiles keep the tests quick. `choices` replace fields of the default policy."""
    from tinyloop.kernels.policy import KernelPolicy

    class InterpreterPolicy(KernelPolicy):
        def matvec_tile(self, n: int, k: int, rows: int, group: int) -> tuple[int, int, int]:
            return 32, max(group, 64), 4

    return InterpreterPolicy(**choices)  # type: ignore[arg-type]


@contextmanager
def models_per_kv_mode(path: Path, windows: dict[str, int], max_seq_len: int = 64) -> Iterator[dict[str, Any]]:
    """One single-threaded Model per KV mode (windows: mode -> cache_window), closed on exit."""
    import tinyloop

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    opened = {
        mode: tinyloop.Model(path, max_seq_len=max_seq_len, kv_mode=mode, cache_window=w) for mode, w in windows.items()
    }
    try:
        yield opened
    finally:
        for m in opened.values():
            m.close()
        torch.set_num_threads(before)
