"""Cached prefill + token-by-token decode equals the naive float64 full recompute, for every option."""

from __future__ import annotations

import pytest
import torch

from helpers import frob_rel_error, max_rel_error, random_flat_weights
from naive_reference import naive_forward
from tinyloop.config import ArchConfig
from tinyloop.model.weights import ModelWeights
from tinyloop.runtime.engine import Engine

BASE = dict(
    vocab_size=97, d_model=32, n_heads=4, n_kv_heads=4, head_dim=8, ffn_dim=48,
    n_prelude=1, n_body=2, n_coda=1, max_position=64,
)  # fmt: skip

VARIANTS = {
    "pre-add-prelude": dict(injection="add", state_start="prelude"),
    "pre-concat-zeros-gqa": dict(injection="concat", state_start="zeros", n_kv_heads=2),
    "mqa-interleaved-qkbias": dict(n_kv_heads=1, rope_pairing="interleaved", qk_bias=True, injection="add"),
    "huginn-like": dict(
        norm_placement="sandwich_sum",
        injection="concat",
        state_start="random",
        state_init_std=0.6,
        loop_norm="after_loop",
        head_norm=True,
        embed_scale=5.0,
        qk_bias=True,
        rope_pairing="interleaved",
    ),
    "ouro-like": dict(
        norm_placement="sandwich_out",
        n_prelude=0,
        n_coda=0,
        n_body=3,
        loop_norm="every_loop",
        head_norm=False,
        tied_embeddings=False,
        exit_gate=True,
        injection="none",
    ),
    "layernorm-gelu-untied": dict(norm_kind="layernorm", ffn_kind="gelu", tied_embeddings=False, logit_scale=0.5),
    "no-prelude-no-coda-add": dict(n_prelude=0, n_coda=0, injection="add", loop_norm="every_loop"),
}


def build(variant: str, seed: int = 0) -> tuple[ArchConfig, dict[str, torch.Tensor], Engine]:
    cfg = ArchConfig(**{**BASE, **VARIANTS[variant]})  # type: ignore[arg-type]
    flat = random_flat_weights(cfg, seed)
    engine = Engine(cfg, ModelWeights.from_flat(cfg, flat), torch.device("cpu"), torch.float32)
    return cfg, flat, engine


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("loops", [1, 2, 7])
def test_decode_matches_naive(variant: str, loops: int) -> None:
    cfg, flat, engine = build(variant)
    tokens = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(loops)).tolist()
    ref_logits, ref_states, ref_gates = naive_forward(cfg, flat, tokens, loops, engine.noise)

    cache = engine.new_cache(1, 32, loops)
    prompt = 5
    out = engine.step(torch.tensor([tokens[:prompt]]), cache, loops, collect_states=True)
    got = [out.logits[0]]
    assert out.states is not None and len(out.states) == 2 + loops
    for i, (s, r) in enumerate(zip(out.states, ref_states, strict=True)):
        assert frob_rel_error(s[0], r[:prompt]) <= 1e-5, f"state {i}"
    for g, r in zip(out.gates, ref_gates, strict=True):
        assert max_rel_error(g[0], r[:prompt]) <= 1e-5
    for t in range(prompt, len(tokens)):
        step = engine.step(torch.tensor([[tokens[t]]]), cache, loops, last_only=True)
        got.append(step.logits[0])
    assert int(cache.lengths[0]) == len(tokens)
    err = max_rel_error(torch.cat(got), ref_logits)
    assert err <= 1e-5, f"{variant} loops={loops}: max relative error {err:.2e}"


@pytest.mark.parametrize("variant", ["pre-concat-zeros-gqa", "huginn-like"])
def test_batch_of_different_lengths_matches_single(variant: str) -> None:
    cfg, flat, engine = build(variant)
    seqs = [[5, 9, 2, 7, 1, 3], [4, 8], [6, 6, 6, 1]]
    loops = 3
    cache = engine.new_cache(len(seqs), 32, loops)
    width = max(len(s) for s in seqs)
    batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    valid = torch.tensor([len(s) for s in seqs])
    out = engine.step(batch, cache, loops, valid=valid, last_only=True)
    step2 = engine.step(torch.tensor([[11], [12], [13]]), cache, loops, last_only=True)
    for b, s in enumerate(seqs):
        ref, _, _ = naive_forward(cfg, flat, s + [11 + b], loops, engine.noise)
        assert max_rel_error(out.logits[b, 0], ref[len(s) - 1]) <= 1e-5
        assert max_rel_error(step2.logits[b, 0], ref[len(s)]) <= 1e-5


def test_truncate_then_redecode_is_exact() -> None:
    cfg, flat, engine = build("pre-add-prelude")
    cache = engine.new_cache(1, 32, 2)
    engine.step(torch.tensor([[1, 2, 3, 4]]), cache, 2)
    snapshot = cache.clone()
    engine.step(torch.tensor([[50, 51]]), cache, 2)
    cache.truncate(4)
    out = engine.step(torch.tensor([[7]]), cache, 2, last_only=True)
    ref, _, _ = naive_forward(cfg, flat, [1, 2, 3, 4, 7], 2)
    assert max_rel_error(out.logits[0, 0], ref[-1]) <= 1e-5
    out2 = engine.step(torch.tensor([[7]]), snapshot, 2, last_only=True)
    assert torch.equal(out2.logits, out.logits)


@pytest.mark.parametrize("variant", ["pre-concat-zeros-gqa", "huginn-like", "ouro-like"])
def test_resume_deeper_over_cached_positions_equals_fresh_deep_run(variant: str) -> None:
    """Warm start: run 2 loops, then only iterations 2..4 over the stored state; equals a fresh 5-loop run."""
    cfg, flat, engine = build(variant)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    cache = engine.new_cache(1, 32, 5)
    shallow = engine.step(torch.tensor([tokens]), cache, 2)
    assert shallow.loop_state is not None and shallow.prelude_out is not None
    deep = engine.step(
        torch.tensor([tokens]), cache, 5, start=torch.tensor([0]),
        resume=shallow.resume_at(2),
    )  # fmt: skip
    ref, _, _ = naive_forward(cfg, flat, tokens + [7], 5, engine.noise)
    assert max_rel_error(deep.logits[0], ref[: len(tokens)]) <= 1e-5
    nxt = engine.step(torch.tensor([[7]]), cache, 5, last_only=True)
    assert max_rel_error(nxt.logits[0, 0], ref[-1]) <= 1e-5
