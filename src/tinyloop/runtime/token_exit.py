"""Token-stable early exit in scoring: a position stops iterating once its argmax has held for N loops.

Exited positions keep their last state; later iterations attend to the K/V that each exited position
produced at its last iteration (per body layer), so attention stays consistent and exited positions
cost nothing in the body. Each iteration's exit check runs the coda and head (the lens exit path).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from tinyloop.cache.kv import KVCache
from tinyloop.model.layers import StepContext
from tinyloop.model.looped import embed, exit_hidden, head, initial_state, loop_iteration, run_prelude
from tinyloop.runtime.engine import Engine


class LatestIterationStore:
    """A KV store with one slot per physical layer: iteration t of body layer j overwrites the same slot,
    so a position that stopped iterating still offers the K/V of its last iteration."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        cfg = cache.cfg
        self._first_body = cfg.n_prelude + cfg.n_coda
        self._n_body = cfg.n_body

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if slot >= self._first_body:
            slot = self._first_body + (slot - self._first_body) % self._n_body
        return self.cache.update(slot, k, v, ctx)


@dataclass
class TokenExitResult:
    logits: torch.Tensor  # [T, V] float32
    exit_depth: torch.Tensor  # [T] iterations each position ran (1..loops)
    loops: int

    @property
    def body_fraction_saved(self) -> float:
        """Share of body position-iterations skipped (the body is where a looped model spends its compute)."""
        total = self.exit_depth.numel() * self.loops
        return 1.0 - float(self.exit_depth.sum()) / total


@torch.inference_mode()
def score_with_token_exit(engine: Engine, tokens: torch.Tensor, loops: int, patience: int) -> TokenExitResult:
    """Score tokens [T] from position 0; a position exits after an iteration at which its argmax has been
    the same for `patience` consecutive iterations (patience >= 1)."""
    cfg, w = engine.cfg, engine.weights
    T = int(tokens.numel())
    dev = engine.device
    store = LatestIterationStore(KVCache(cfg, 1, T, 1, dev, engine.dtype))
    positions = torch.arange(T, device=dev)[None]
    full_ctx = engine.context(positions, None, None)
    x = embed(w, cfg, tokens.view(1, -1).to(dev), engine.dtype)
    p = run_prelude(w, cfg, x, full_ctx)
    s = initial_state(cfg, p, positions, engine.noise).clone()
    active = torch.ones(T, dtype=torch.bool, device=dev)
    exit_depth = torch.full((T,), loops, dtype=torch.long, device=dev)
    last_argmax = torch.full((T,), -1, dtype=torch.long, device=dev)
    streak = torch.zeros(T, dtype=torch.long, device=dev)
    for t in range(loops):
        idx = active.nonzero().squeeze(1)
        ctx = engine.context(idx[None], store, T)
        s[:, idx] = loop_iteration(w, cfg, s[:, idx], p[:, idx], ctx, t)
        if t == loops - 1:
            break
        argmax = head(w, cfg, exit_hidden(w, cfg, s, full_ctx)[:, idx])[0].argmax(-1)
        same = argmax == last_argmax[idx]
        streak[idx] = torch.where(same, streak[idx] + 1, torch.zeros_like(streak[idx]))
        last_argmax[idx] = argmax
        done = idx[streak[idx] >= patience]
        exit_depth[done] = t + 1
        active[done] = False
        if not bool(active.any()):
            break
    logits = head(w, cfg, exit_hidden(w, cfg, s, full_ctx))[0]
    return TokenExitResult(logits=logits, exit_depth=exit_depth.cpu(), loops=loops)


def report_token_exit(res: TokenExitResult) -> None:
    """TINYLOOP_TOKEN_EXIT_VERBOSE: per-position exit depths and the body compute saved, to stderr."""
    depths = res.exit_depth.tolist()
    print(f"[tinyloop] token exit depths (of {res.loops}): {depths}", file=sys.stderr)
    print(
        f"[tinyloop] token exit: mean depth {sum(depths) / len(depths):.2f}, "
        f"body compute saved {100 * res.body_fraction_saved:.1f}%",
        file=sys.stderr,
    )
