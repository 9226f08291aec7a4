"""Depth schedules: decode the first tokens with fewer loop iterations, the rest at full depth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tinyloop.cache.kv import KVCache
from tinyloop.cache.window import WindowKVCache
from tinyloop.model.slots import body_slot


@dataclass(frozen=True)
class DepthSchedule:
    """The first `warmup_tokens` decode steps (after the prefill, which runs at full depth) run
    `warmup_loops` iterations; the rest run at full depth.

    What a deeper iteration reads at a position decoded shallower: the deepest iteration computed for
    that position. After a shallow step, the K/V of its last iteration (warmup_loops - 1) are copied
    into the body slots of every iteration it skipped, so later full-depth tokens attend, at iteration
    t, to K/V that are exact by this rule. Positions decoded at full depth are untouched (== plain).
    The coda K/V of a shallow position come from its shallow exit state, as computed.

    Works with every positional KV mode and with the sliding window (cache_window > 0), where the copy
    is made in the ring entry that holds the position; with the window, later tokens see a shallow
    position only while it is inside their window, as for any other position. With speculative
    decoding the warm-up steps are plain shallow steps and speculation starts after them.
    """

    warmup_tokens: int = 0
    warmup_loops: int = 2

    def loops_for(self, decode_step: int, loops: int) -> int:
        """Loops for decode step `decode_step` (1-based; the prefill is step 0)."""
        return min(self.warmup_loops, loops) if 1 <= decode_step <= self.warmup_tokens else loops


def fill_skipped_iterations(cache: Any, ran: int, loops: int, start: int, end: int, row: int | None = None) -> None:
    """Copy iteration ran-1's body K/V at positions [start, end) into iterations ran..loops-1 (of every
    batch row, or of `row` only)."""
    if ran >= loops:
        return
    cfg = cache.cfg
    src = [body_slot(cfg, ran - 1, j) for _ in range(ran, loops) for j in range(cfg.n_body)]
    dst = [body_slot(cfg, t, j) for t in range(ran, loops) for j in range(cfg.n_body)]
    if isinstance(cache, WindowKVCache):
        if end - start > cache.window:
            raise ValueError(f"cannot fill {end - start} positions in a sliding window of {cache.window}")
        # Position p lives at ring index p % window (every slot holds the same positions).
        spans = [(p % cache.window, 1) for p in range(start, end)]
        buffers = [(cache.k, 3), (cache.v, 3)]
    else:
        spans = [(start, end - start)]
        buffers = _position_buffers(cache)
    for buf, axis in buffers:
        for index, length in spans:
            span = buf.narrow(axis, index, length)
            if row is not None:
                span = span.narrow(1, row, 1)  # buffers are [slots, batch, ...]
            span[dst] = span[src]


def _position_buffers(cache: Any) -> list[tuple[torch.Tensor, int]]:
    """The cache's per-slot buffers that hold position p at index p along the given axis."""
    positional = getattr(cache, "_positional", None)
    if positional is not None:
        return list(positional().values())
    if isinstance(cache, KVCache):
        return [(cache.k, 3), (cache.v, 3)]
    name = type(cache).__name__
    raise ValueError(f"a depth schedule needs a positional or sliding-window KV cache; {name} is neither")
