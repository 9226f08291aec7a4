"""The "16bit" KV mode: the static KVCache, with prefix snapshots and an optional narrower storage dtype."""

from __future__ import annotations

import torch

from tinyloop.cache.base import PositionalSnapshots
from tinyloop.cache.kv import KVCache
from tinyloop.config import ArchConfig
from tinyloop.model.layers import StepContext


class DenseKVCache(PositionalSnapshots, KVCache):
    """K and V in the compute dtype (the default), or stored in `storage_dtype` (e.g. float16 on CPU,
    to measure a true 16-bit footprint) and widened to the compute dtype when attended to."""

    mode = "16bit"

    def __init__(
        self,
        cfg: ArchConfig,
        batch: int,
        max_seq: int,
        loops: int,
        device: torch.device | str,
        dtype: torch.dtype,
        storage_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(cfg, batch, max_seq, loops, device, storage_dtype or dtype)
        self.compute_dtype = dtype

    def _positional(self) -> dict[str, tuple[torch.Tensor, int]]:
        return {"k": (self.k, 3), "v": (self.v, 3)}

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k.dtype == k.dtype:
            return super().update(slot, k, v, ctx)
        k_all, v_all = super().update(slot, k.to(self.k.dtype), v.to(self.v.dtype), ctx)
        # Round the step's own K/V too, so results never depend on how a sequence was split into steps.
        return k_all.to(k.dtype), v_all.to(v.dtype)
