"""The sliding-window KV mode: a ring of the last N positions per slot; a query at position q attends to
keys at positions q-N+1..q only, so its logits equal a full cache whose attention is limited to that window."""

from __future__ import annotations

import torch

from tinyloop.cache.base import RowViews, allocate, copy_out, row_lengths
from tinyloop.config import ArchConfig
from tinyloop.model.layers import StepContext


class WindowKVCache(RowViews):
    """k, v: [slots, B, kv_heads, N, hd] in the compute dtype; position p lives at ring index p % N.

    `ring_pos[b, i]` is the position ring index i holds in row b (-1: empty); every slot holds the same
    positions. A step attends over [ring before the step; the step's own tokens] ([B, 1, T, N + T] mask
    from `begin_step`), then keeps each row's last N valid tokens in the ring.
    """

    mode = "window"
    _row_state = ("lengths", "ring_pos")

    def __init__(
        self,
        cfg: ArchConfig,
        batch: int,
        max_seq: int,
        loops: int,
        device: torch.device | str,
        dtype: torch.dtype,
        window: int,
    ) -> None:
        if window <= 0:
            raise ValueError(f"cache_window must be a positive integer for a sliding-window cache, got {window}")
        self.cfg, self.loops, self.max_seq, self.window = cfg, loops, max_seq, window
        shape = (cfg.n_cache_slots(loops), batch, cfg.n_kv_heads, window, cfg.head_dim)
        self.k = allocate(shape, dtype, device, "sliding-window KV cache")
        self.v = allocate(shape, dtype, device, "sliding-window KV cache")
        self.ring_pos = torch.full((batch, window), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self._write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.ring_pos.nbytes

    def begin_step(self, positions: torch.Tensor, start: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The step's attention mask [B, 1, T, N + T]; also fixes which tokens each slot's update keeps."""
        W, dev = self.window, positions.device
        T = positions.shape[1]
        if bool((start + valid < self.lengths).any()):
            raise ValueError("a sliding-window cache can only rewrite positions up to its end; truncate it first")
        start_d, valid_d = start.to(dev)[:, None], valid.to(dev)[:, None]
        q = positions[:, :, None]  # [B, T, 1]
        old = self.ring_pos[:, None, :]  # [B, 1, N]
        # Ring entries at positions >= start are superseded by this step's tokens.
        old_ok = (old >= 0) & (old < start_d[:, :, None]) & (old > q - W)
        new = positions[:, None, :]  # [B, 1, T]; padded keys sit right of every real query, so never seen
        new_ok = (new <= q) & (new > q - W)
        t = torch.arange(T, device=dev)[None, :]
        keep = (t < valid_d) & (t >= valid_d - W)  # [B, T]: the last N real tokens of each row
        b_idx, t_idx = keep.nonzero(as_tuple=True)
        kept_pos = positions[b_idx, t_idx]
        ring = self.ring_pos.masked_fill(self.ring_pos >= start_d, -1)
        ring[b_idx, kept_pos % W] = kept_pos
        self.ring_pos = ring
        self._write = (b_idx, t_idx, kept_pos % W)
        return torch.cat((old_ok, new_ok), dim=-1).unsqueeze(1)

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._write is None:
            raise RuntimeError("a sliding-window cache needs begin_step() before each step (use Engine.step)")
        k_all = torch.cat((self.k[slot], k), dim=2)  # [B, KVH, N + T, hd]
        v_all = torch.cat((self.v[slot], v), dim=2)
        b, t, r = self._write
        self.k[slot][b, :, r] = k[b, :, t]
        self.v[slot][b, :, r] = v[b, :, t]
        return k_all, v_all

    def _holds(self, row: int, use: int) -> bool:
        """Whether the ring of `row` holds every position a query after `use` tokens can see."""
        need = torch.arange(max(0, use - self.window), use, device=self.ring_pos.device)
        return bool((self.ring_pos[row, need % self.window] == need).all())

    def truncate(self, length: int | torch.Tensor) -> None:
        """Roll back; exact only while the ring still holds the window before the new end."""
        new = row_lengths(length, self.batch)
        if bool((new < 0).any()) or bool((new > self.lengths).any()):
            raise ValueError(f"cannot truncate a cache of lengths {self.lengths.tolist()} to {new.tolist()}")
        for b in range(self.batch):
            if not self._holds(b, int(new[b])):
                raise ValueError(
                    f"a sliding-window cache of {self.window} positions cannot roll back from "
                    f"{int(self.lengths[b])} to {int(new[b])} tokens (those positions were overwritten); "
                    "use cache_window=0 for a rewindable cache"
                )
        self.ring_pos = self.ring_pos.masked_fill(self.ring_pos >= new.to(self.ring_pos.device)[:, None], -1)
        self.lengths = new

    def snapshot(self, length: int, loops: int, row: int = 0) -> dict[str, torch.Tensor]:
        if length != int(self.lengths[row]) or loops > self.loops:
            raise ValueError(f"a sliding-window cache snapshots its whole row ({int(self.lengths[row])} tokens)")
        n = self.cfg.n_cache_slots(loops)
        return {
            "k": copy_out(self.k[:n, row], "prefix snapshot"),
            "v": copy_out(self.v[:n, row], "prefix snapshot"),
            "ring_pos": copy_out(self.ring_pos[row], "prefix snapshot"),
        }

    def restore(self, tensors: dict[str, torch.Tensor], length: int, loops: int, use: int, row: int = 0) -> None:
        if not self.can_use(length, use) or loops > self.loops or tensors["k"].shape[2] != self.window:
            raise ValueError(f"cannot restore {use} of {length} tokens into a sliding-window cache of "
                             f"{self.window} positions at {self.loops} loops")  # fmt: skip
        n = self.cfg.n_cache_slots(loops)
        self.k[:n, row].copy_(tensors["k"])
        self.v[:n, row].copy_(tensors["v"])
        pos = tensors["ring_pos"].to(self.ring_pos.device)
        self.ring_pos = self.ring_pos.clone()
        self.ring_pos[row] = pos.masked_fill(pos >= use, -1)
        self.lengths = self.lengths.clone()
        self.lengths[row] = use

    def clear_row(self, row: int) -> None:
        self.k[:, row].zero_()
        self.v[:, row].zero_()
        self.ring_pos = self.ring_pos.clone()
        self.ring_pos[row] = -1
        self.lengths = self.lengths.clone()
        self.lengths[row] = 0

    def can_use(self, length: int, use: int) -> bool:
        """A snapshot of `length` tokens serves its first `use` if the ring kept everything they see."""
        return 0 <= use <= length and (use == length or length <= self.window)

    def check_integrity(self) -> None:
        assert self.k.shape == self.v.shape and self.k.shape[0] == self.cfg.n_cache_slots(self.loops)
        for b in range(self.batch):
            held = self.ring_pos[b]
            idx = torch.arange(self.window, device=held.device)
            assert bool(((held < 0) | (held % self.window == idx)).all()), "ring index/position mismatch"
            assert bool((held < int(self.lengths[b])).all()), "ring holds positions past the row's length"
            assert self._holds(b, int(self.lengths[b])), "ring lost positions inside the window"
