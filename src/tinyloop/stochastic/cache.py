"""Effective weights already drawn, kept up to a byte budget so CPU decode steps do not redraw them."""

from __future__ import annotations

import torch

MiB = 1 << 20


class EffectiveCache:
    """(call, iteration, dtype) -> effective weight; the first ones drawn are kept until the budget is full.

    No eviction: loops revisit iterations in a cycle, where least-recently-used would miss every time.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._store: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def get(self, call: int, iteration: int, dtype: torch.dtype) -> torch.Tensor | None:
        return self._store.get((call, iteration, dtype))

    def put(self, call: int, iteration: int, dtype: torch.dtype, weight: torch.Tensor) -> None:
        if self.used_bytes + weight.nbytes <= self.budget_bytes:
            self._store[(call, iteration, dtype)] = weight
            self.used_bytes += weight.nbytes

    def __len__(self) -> int:
        return len(self._store)
