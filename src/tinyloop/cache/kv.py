"""Static KV buffers: one slot per (loop iteration, layer), allocated once for max_seq_len tokens."""

from __future__ import annotations

import torch

from tinyloop.config import ArchConfig
from tinyloop.errors import OutOfMemoryError
from tinyloop.model.layers import StepContext


class KVCache:
    """K and V for `batch` sequences: tensors [slots, B, kv_heads, max_seq, head_dim].

    Shapes never change after allocation, so a decode step has fixed shapes (CUDA-graph ready).
    `lengths[b]` counts the tokens stored for row b; entries past it are stale and never attended to.
    """

    def __init__(
        self, cfg: ArchConfig, batch: int, max_seq: int, loops: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        self.cfg = cfg
        self.loops = loops
        self.max_seq = max_seq
        shape = (cfg.n_cache_slots(loops), batch, cfg.n_kv_heads, max_seq, cfg.head_dim)
        try:
            # Zeros, not empty: masked-out entries still enter the attention matmul (0 * NaN = NaN).
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            need = 2 * torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
            raise OutOfMemoryError(f"KV cache of {need / 2**20:.1f} MiB for {shape} on {device}: {exc}") from None
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self._rows = torch.arange(batch, device=device)

    @classmethod
    def _from_buffers(
        cls, cfg: ArchConfig, loops: int, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
    ) -> KVCache:
        self = cls.__new__(cls)
        self.cfg, self.loops, self.max_seq = cfg, loops, int(k.shape[3])
        self.k, self.v, self.lengths = k, v, lengths
        self._rows = torch.arange(k.shape[1], device=k.device)
        return self

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([B, kv_heads, T, hd]) at ctx.positions; return the span to attend to."""
        rows = self._rows[:, None].expand_as(ctx.positions)
        self.k[slot][rows, :, ctx.positions] = k.transpose(1, 2)
        self.v[slot][rows, :, ctx.positions] = v.transpose(1, 2)
        if ctx.mask is None:  # the step starts at position 0 for every row: its own tokens are all there is
            return k, v
        span = ctx.mask.shape[-1]
        return self.k[slot, :, :, :span], self.v[slot, :, :, :span]

    def truncate(self, length: int | torch.Tensor) -> None:
        """Roll back to `length` tokens (per row when a tensor)."""
        new = torch.as_tensor(length, dtype=torch.long).expand(self.batch).clone()
        if bool((new < 0).any()) or bool((new > self.lengths).any()):
            raise ValueError(f"cannot truncate a cache of lengths {self.lengths.tolist()} to {new.tolist()}")
        self.lengths = new

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        """An independent cache whose row i copies row rows[i] of this one (a prefix forked into rows that
        each continue it differently)."""
        index = rows.to(self.k.device)
        k, v = self.k.index_select(1, index), self.v.index_select(1, index)
        return KVCache._from_buffers(self.cfg, self.loops, k, v, self.lengths[rows.cpu()].clone())

    def clone(self) -> KVCache:
        """An independent snapshot."""
        return KVCache._from_buffers(self.cfg, self.loops, self.k.clone(), self.v.clone(), self.lengths.clone())

    def check_integrity(self) -> None:
        assert self.k.shape == self.v.shape
        assert self.k.shape[0] == self.cfg.n_cache_slots(self.loops)
        assert bool((self.lengths >= 0).all()) and bool((self.lengths <= self.max_seq).all())
