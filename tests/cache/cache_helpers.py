"""Shared pieces of the cache tests: small engines, a masked-attention window reference, split runs."""

from __future__ import annotations

import torch

from helpers import random_flat_weights
from tinyloop.cache.base import StepCache
from tinyloop.config import ArchConfig
from tinyloop.model.layers import StepContext
from tinyloop.model.looped import forward
from tinyloop.model.weights import ModelWeights
from tinyloop.presets import preset
from tinyloop.runtime.engine import Engine

CONFIGS = {
    "test-tiny": preset("test-tiny"),  # GQA, concat injection, zero start
    "huginn-like": ArchConfig(
        vocab_size=97, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, n_prelude=1, n_body=2,
        n_coda=1, max_position=128, norm_placement="sandwich_sum", injection="concat", state_start="random",
        state_init_std=0.6, loop_norm="after_loop", qk_bias=True, rope_pairing="interleaved", embed_scale=5.0,
    ),
}  # fmt: skip


def engine_for(name: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], Engine]:
    cfg = CONFIGS[name]
    flat = random_flat_weights(cfg, seed)
    return flat, Engine(cfg, ModelWeights.from_flat(cfg, flat), torch.device("cpu"), torch.float32)


def random_tokens(cfg: ArchConfig, n: int, seed: int) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _PassThrough:
    """Attend over exactly this step's K/V: the whole sequence runs in one step."""

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


@torch.inference_mode()
def windowed_logits(engine: Engine, tokens: list[int], loops: int, window: int) -> torch.Tensor:
    """[T, V]: one full forward whose attention is masked to keys at positions q-window+1..q."""
    T = len(tokens)
    pos = torch.arange(T)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    ctx = StepContext(pos[None], engine.cos[pos][None], engine.sin[pos][None], band[None, None], _PassThrough())
    out = forward(engine.weights, engine.cfg, torch.tensor([tokens]), ctx, loops, dtype=engine.dtype,
                  noise=engine.noise)  # fmt: skip
    return out.logits[0]


@torch.inference_mode()
def split_run(
    engine: Engine, cache: StepCache | None, tokens: list[int], loops: int, chunks: list[int]
) -> torch.Tensor:
    """Logits [T, V] of running `tokens` through `cache` in chunks of the given sizes."""
    assert sum(chunks) == len(tokens)
    out, at = [], 0
    for size in chunks:
        out.append(engine.step(torch.tensor([tokens[at : at + size]]), cache, loops).logits[0])
        at += size
    return torch.cat(out)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in nats."""
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)
