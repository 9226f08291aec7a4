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
from tinyloop.model.looped import token_exit_forward
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
    T = int(tokens.numel())
    dev = engine.device
    store = LatestIterationStore(KVCache(engine.cfg, 1, T, 1, dev, engine.dtype))
    full_ctx = engine.context(torch.arange(T, device=dev)[None], None, None)
    logits, exit_depth = token_exit_forward(
        engine.weights, engine.cfg, tokens.view(1, -1).to(dev), full_ctx,
        lambda idx: engine.context(idx[None], store, T), loops, patience, dtype=engine.dtype, noise=engine.noise,
    )  # fmt: skip
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
