"""The "int8" KV mode: symmetric INT8 per (token, head) with one float16 scale; attention reads dequantized spans."""

from __future__ import annotations

import torch

from tinyloop.cache.base import PositionalSnapshots, allocate, row_lengths
from tinyloop.config import ArchConfig
from tinyloop.model.layers import StepContext

_FP16_MAX = 65504.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hd] -> (int8 [..., hd], float16 scale [...]) with x ~= q * scale."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / 127.0).clamp(min=2.0**-24, max=_FP16_MAX).to(torch.float16)
    q = torch.round(xf / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)


class Int8KVCache(PositionalSnapshots):
    """k, v: int8 [slots, B, kv_heads, max_seq, hd]; k_scale, v_scale: float16 [slots, B, kv_heads, max_seq].

    Every span attention reads is dequantized, the step's own tokens included, so a sequence gives the
    same logits however it was split into steps (prefix caches and resume stay exact in this mode).
    """

    mode = "int8"

    def __init__(
        self, cfg: ArchConfig, batch: int, max_seq: int, loops: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        self.cfg, self.loops, self.max_seq, self.dtype = cfg, loops, max_seq, dtype
        shape = (cfg.n_cache_slots(loops), batch, cfg.n_kv_heads, max_seq, cfg.head_dim)
        self.k = allocate(shape, torch.int8, device, "INT8 KV cache")
        self.v = allocate(shape, torch.int8, device, "INT8 KV cache")
        self.k_scale = allocate(shape[:-1], torch.float16, device, "INT8 KV scales")
        self.v_scale = allocate(shape[:-1], torch.float16, device, "INT8 KV scales")
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self._rows = torch.arange(batch, device=device)

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def _positional(self) -> dict[str, tuple[torch.Tensor, int]]:
        return {"k": (self.k, 3), "v": (self.v, 3), "k_scale": (self.k_scale, 3), "v_scale": (self.v_scale, 3)}

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qk, sk = quantize(k)  # [B, KVH, T, hd], [B, KVH, T]
        qv, sv = quantize(v)
        rows = self._rows[:, None].expand_as(ctx.positions)
        self.k[slot][rows, :, ctx.positions] = qk.transpose(1, 2)
        self.v[slot][rows, :, ctx.positions] = qv.transpose(1, 2)
        self.k_scale[slot][rows, :, ctx.positions] = sk.transpose(1, 2)
        self.v_scale[slot][rows, :, ctx.positions] = sv.transpose(1, 2)
        if ctx.mask is None:
            return dequantize(qk, sk, k.dtype), dequantize(qv, sv, v.dtype)
        span = ctx.mask.shape[-1]
        return (
            dequantize(self.k[slot, :, :, :span], self.k_scale[slot, :, :, :span], k.dtype),
            dequantize(self.v[slot, :, :, :span], self.v_scale[slot, :, :, :span], v.dtype),
        )

    def truncate(self, length: int | torch.Tensor) -> None:
        new = row_lengths(length, self.batch)
        if bool((new < 0).any()) or bool((new > self.lengths).any()):
            raise ValueError(f"cannot truncate a cache of lengths {self.lengths.tolist()} to {new.tolist()}")
        self.lengths = new

    def check_integrity(self) -> None:
        assert self.k.shape == self.v.shape and self.k_scale.shape == self.k.shape[:-1]
        assert self.k.shape[0] == self.cfg.n_cache_slots(self.loops)
        assert bool((self.lengths >= 0).all()) and bool((self.lengths <= self.max_seq).all())
