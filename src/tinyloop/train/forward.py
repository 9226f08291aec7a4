"""The training forward pass: the model's own functions, with backprop through the last iterations only."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tinyloop.config import ArchConfig
from tinyloop.model.layers import StepContext, rope_tables
from tinyloop.model.looped import embed, exit_hidden, head, initial_state, loop_iteration, run_prelude
from tinyloop.model.weights import ModelWeights

IterationFn = Callable[..., torch.Tensor]


class RopeCache:
    """RoPE tables for positions 0..T-1, built once per device and length."""

    def __init__(self, cfg: ArchConfig) -> None:
        self.cfg = cfg
        self._tables: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def context(self, batch: int, length: int, device: torch.device) -> StepContext:
        key = (str(device), length)
        if key not in self._tables:
            self._tables[key] = rope_tables(self.cfg, length, device)
        cos, sin = self._tables[key]
        positions = torch.arange(length, device=device)[None, :].expand(batch, length)
        # [1, T, hd/2] broadcasts over the batch inside apply_rope.
        return StepContext(positions, cos[None], sin[None], mask=None, cache=None)


def train_logits(
    w: ModelWeights,
    cfg: ArchConfig,
    tokens: torch.Tensor,
    ctx: StepContext,
    loops: int,
    grad_loops: int,
    iteration: IterationFn = loop_iteration,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [B, T, V] at `loops` iterations; the first loops - grad_loops run without autograd and
    their state is detached (truncated backprop through the recurrence, as Huginn trains).

    `iteration` is loop_iteration or a compiled copy of it; the loop index it gets only picks KV-cache
    slots, so with no cache it is always 0 (one compiled graph serves every iteration).
    """
    e = embed(w, cfg, tokens, torch.float32)
    p = run_prelude(w, cfg, e, ctx)
    s = initial_state(cfg, p, ctx.positions, noise)
    k = min(loops, grad_loops)
    if loops > k:
        with torch.no_grad():
            for _ in range(loops - k):
                s = iteration(w, cfg, s, p, ctx, 0)
        s = s.detach()
    for _ in range(k):
        s = iteration(w, cfg, s, p, ctx, 0)
    return head(w, cfg, exit_hidden(w, cfg, s, ctx))
