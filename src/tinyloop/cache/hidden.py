"""The "hidden" KV mode: store each layer's normalized attention input instead of K and V (no K/V
buffers at all) and rebuild K/V from it, with RoPE at the stored positions, whenever attention reads."""

from __future__ import annotations

import torch

from tinyloop.cache.base import PositionalSnapshots, allocate, row_lengths
from tinyloop.config import ArchConfig
from tinyloop.model.hidden_kv import kv_from_hidden
from tinyloop.model.layers import StepContext, rope_tables
from tinyloop.model.weights import LayerWeights


class HiddenStateCache(PositionalSnapshots):
    """h: [slots, B, max_seq, d_model] in the compute dtype: d_model values per (slot, token) instead of
    2 * kv_heads * head_dim. Costs a K/V projection over the attended span at every read."""

    mode = "hidden"
    stores_hidden = True

    def __init__(
        self, cfg: ArchConfig, batch: int, max_seq: int, loops: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        self.cfg, self.loops, self.max_seq = cfg, loops, max_seq
        self.h = allocate((cfg.n_cache_slots(loops), batch, max_seq, cfg.d_model), dtype, device, "hidden-state cache")
        self.cos, self.sin = rope_tables(cfg, max_seq, device)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self._rows = torch.arange(batch, device=device)

    @property
    def batch(self) -> int:
        return int(self.h.shape[1])

    @property
    def nbytes(self) -> int:
        return self.h.nbytes

    def _positional(self) -> dict[str, tuple[torch.Tensor, int]]:
        return {"h": (self.h, 2)}

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("a hidden-state cache is written through update_hidden (stores_hidden = True)")

    def update_hidden(
        self, slot: int, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, w: LayerWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store h [B, T, d] at ctx.positions; return K/V of the span to attend to (this step's own k, v
        when the step starts at position 0)."""
        rows = self._rows[:, None].expand_as(ctx.positions)
        self.h[slot][rows, ctx.positions] = h.to(self.h.dtype)
        if ctx.mask is None:
            return k, v
        span = ctx.mask.shape[-1]
        return kv_from_hidden(self.h[slot, :, :span], w, self.cfg, self.cos[:span], self.sin[:span])

    def truncate(self, length: int | torch.Tensor) -> None:
        new = row_lengths(length, self.batch)
        if bool((new < 0).any()) or bool((new > self.lengths).any()):
            raise ValueError(f"cannot truncate a cache of lengths {self.lengths.tolist()} to {new.tolist()}")
        self.lengths = new

    def check_integrity(self) -> None:
        assert self.h.shape[0] == self.cfg.n_cache_slots(self.loops)
        assert bool((self.lengths >= 0).all()) and bool((self.lengths <= self.max_seq).all())
