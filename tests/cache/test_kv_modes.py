"""The five KV modes against references: 16bit and hidden vs the naive float64 forward, INT8 vs 16bit,
the sliding window vs a full forward whose attention is masked to the window."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import CONFIGS, engine_for, kl, random_tokens, split_run, windowed_logits

from helpers import max_rel_error
from naive_reference import naive_forward
from tinyloop.cache.base import ModeCache
from tinyloop.cache.dense import DenseKVCache
from tinyloop.cache.factory import KVModeChoice, kv_bytes_per_token, make_cache, resolve_kv_mode
from tinyloop.cache.hidden import HiddenStateCache
from tinyloop.cache.int8 import Int8KVCache, dequantize, quantize
from tinyloop.cache.window import WindowKVCache
from tinyloop.env import RuntimeEnv
from tinyloop.runtime.engine import Engine
from tinyloop.train.tiny_config import TINY_CONFIG

CPU = torch.device("cpu")
CHUNKS = [7, 1, 1, 4, 1, 2]  # a prefill, single-token decodes and multi-token appends


def _cache(engine: Engine, mode: str, loops: int, window: int = 0, batch: int = 1) -> ModeCache | None:
    return make_cache(KVModeChoice(mode, window), engine.cfg, batch, 48, loops, CPU, engine.dtype)


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_full_precision_modes_match_the_naive_reference(variant: str) -> None:
    flat, engine = engine_for(variant)
    tokens = random_tokens(engine.cfg, sum(CHUNKS), seed=1)
    ref, _, _ = naive_forward(engine.cfg, flat, tokens, 3, engine.noise)
    for mode in ("16bit", "hidden"):
        got = split_run(engine, _cache(engine, mode, 3), tokens, 3, CHUNKS)
        assert max_rel_error(got, ref) <= 1e-5, mode


def test_hidden_mode_stores_no_kv_and_equals_the_default_mode() -> None:
    _, engine = engine_for("huginn-like")
    tokens = random_tokens(engine.cfg, sum(CHUNKS), seed=2)
    hidden = _cache(engine, "hidden", 4)
    assert isinstance(hidden, HiddenStateCache) and not hasattr(hidden, "k") and not hasattr(hidden, "v")
    dense = split_run(engine, _cache(engine, "16bit", 4), tokens, 4, CHUNKS)
    assert max_rel_error(split_run(engine, hidden, tokens, 4, CHUNKS), dense) <= 1e-5
    hidden.check_integrity()


def test_int8_quantizer_round_trip() -> None:
    x = torch.randn(2, 3, 5, 16) * torch.logspace(-3, 2, 5)[None, None, :, None]
    x[0, 0, 0] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == x.shape[:-1]
    err = (dequantize(q, scale, torch.float32) - x).abs()
    assert bool((err <= scale.float()[..., None] * 0.5 + 1e-6 * x.abs()).all())
    assert bool((dequantize(q, scale, torch.float32)[0, 0, 0] == 0).all())


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_int8_is_close_to_16bit_and_independent_of_step_splits(variant: str) -> None:
    _, engine = engine_for(variant)
    tokens = random_tokens(engine.cfg, sum(CHUNKS), seed=3)
    dense = split_run(engine, _cache(engine, "16bit", 3), tokens, 3, CHUNKS)
    int8 = split_run(engine, _cache(engine, "int8", 3), tokens, 3, CHUNKS)
    assert float(kl(dense, int8).mean()) < 1e-3
    whole = split_run(engine, _cache(engine, "int8", 3), tokens, 3, [len(tokens)])
    # Not bit-equal: float32 sums differ between one step and many, which can flip an INT8 code that lies
    # on a rounding boundary (one step of a row's scale); a wrong split would be off by orders more.
    assert max_rel_error(whole, int8) <= 5e-5


@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_window_equals_masked_full_attention(variant: str, window: int) -> None:
    _, engine = engine_for(variant)
    tokens = random_tokens(engine.cfg, sum(CHUNKS), seed=4)
    cache = _cache(engine, "window", 3, window)
    assert isinstance(cache, WindowKVCache)
    got = split_run(engine, cache, tokens, 3, CHUNKS)
    assert max_rel_error(got, windowed_logits(engine, tokens, 3, window)) <= 1e-5
    cache.check_integrity()
    assert cache.k.shape[3] == window  # memory bounded by the window, not by max_seq


def test_window_as_wide_as_the_sequence_equals_a_full_cache() -> None:
    _, engine = engine_for("test-tiny")
    tokens = random_tokens(engine.cfg, sum(CHUNKS), seed=5)
    full = split_run(engine, _cache(engine, "16bit", 2), tokens, 2, CHUNKS)
    assert max_rel_error(split_run(engine, _cache(engine, "window", 2, 48), tokens, 2, CHUNKS), full) <= 1e-5


def test_window_batch_of_different_lengths() -> None:
    _, engine = engine_for("huginn-like")
    seqs = [random_tokens(engine.cfg, n, seed=n) for n in (9, 3, 6)]
    cache = _cache(engine, "window", 2, 4, batch=3)
    width = max(map(len, seqs))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    out = engine.step(batch, cache, 2, valid=torch.tensor([len(s) for s in seqs]), last_only=True)
    nxt = engine.step(torch.tensor([[1], [2], [3]]), cache, 2, last_only=True)
    for b, s in enumerate(seqs):
        ref = windowed_logits(engine, s + [1 + b], 2, 4)
        assert max_rel_error(out.logits[b, 0], ref[len(s) - 1]) <= 1e-5
        assert max_rel_error(nxt.logits[b, 0], ref[len(s)]) <= 1e-5
    cache.check_integrity()


def test_window_rollback_only_within_what_the_ring_still_holds() -> None:
    _, engine = engine_for("test-tiny")
    tokens = random_tokens(engine.cfg, 12, seed=6)
    cache = _cache(engine, "window", 2, 4)
    split_run(engine, cache, tokens, 2, [12])
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.truncate(10)
    cache.truncate(0)
    cache.check_integrity()
    short = _cache(engine, "window", 2, 8)
    split_run(engine, short, tokens[:6], 2, [6])
    short.truncate(4)  # the ring never wrapped: everything is still there
    out = engine.step(torch.tensor([[tokens[4]]]), short, 2, last_only=True)
    assert max_rel_error(out.logits[0, 0], windowed_logits(engine, tokens[:5], 2, 8)[-1]) <= 1e-5


def test_float16_storage_halves_the_bytes_and_stays_close() -> None:
    _, engine = engine_for("test-tiny")
    tokens = random_tokens(engine.cfg, sum(CHUNKS), seed=7)
    f32 = DenseKVCache(engine.cfg, 1, 48, 2, CPU, torch.float32)
    f16 = DenseKVCache(engine.cfg, 1, 48, 2, CPU, torch.float32, storage_dtype=torch.float16)
    assert f16.nbytes * 2 == f32.nbytes
    a, b = split_run(engine, f32, tokens, 2, CHUNKS), split_run(engine, f16, tokens, 2, CHUNKS)
    assert float(kl(a, b).mean()) < 1e-4


def test_bytes_per_token_and_footprints_for_the_builtin_shape() -> None:
    cfg, loops = TINY_CONFIG, 8
    fp16 = kv_bytes_per_token(KVModeChoice("16bit"), cfg, loops, torch.float32, torch.float16)
    int8 = kv_bytes_per_token(KVModeChoice("int8"), cfg, loops, torch.float32)
    hidden = kv_bytes_per_token(KVModeChoice("hidden"), cfg, loops, torch.float32)
    dense = kv_bytes_per_token(KVModeChoice("16bit"), cfg, loops, torch.float32)
    assert int8 / fp16 <= 0.52 and 1 - hidden / dense >= 0.45
    assert kv_bytes_per_token(KVModeChoice("none"), cfg, loops, torch.float32) == 0
    caches = {
        "16bit": DenseKVCache(cfg, 1, 16, loops, CPU, torch.float32, torch.float16),
        "int8": Int8KVCache(cfg, 1, 16, loops, CPU, torch.float32),
        "hidden": HiddenStateCache(cfg, 1, 16, loops, CPU, torch.float32),
    }
    assert caches["16bit"].nbytes == 16 * fp16 and caches["int8"].nbytes == 16 * int8
    assert caches["hidden"].nbytes == 16 * hidden


def _env(**flags: bool) -> RuntimeEnv:
    base = dict(RuntimeEnv.read().__dict__)
    base.update(disable_kv_cache=False, kv_int8=False, kv_h_mode=False)
    base.update(flags)
    return RuntimeEnv(**base)


def test_mode_resolution_arguments_and_environment() -> None:
    assert resolve_kv_mode(_env(), None, None) == KVModeChoice("16bit")
    assert resolve_kv_mode(_env(kv_int8=True), None, None) == KVModeChoice("int8")
    assert resolve_kv_mode(_env(kv_h_mode=True), None, 0) == KVModeChoice("hidden")
    assert resolve_kv_mode(_env(disable_kv_cache=True, kv_int8=True), None, None) == KVModeChoice("none")
    assert resolve_kv_mode(_env(), None, 16) == KVModeChoice("window", 16)
    assert resolve_kv_mode(_env(kv_int8=True), "hidden", None) == KVModeChoice("hidden")
    assert resolve_kv_mode(_env(), "window", 5) == KVModeChoice("window", 5)
    for env, mode, window, needle in [
        (_env(kv_int8=True, kv_h_mode=True), None, None, "cannot both be set"),
        (_env(kv_int8=True), None, 8, "TINYLOOP_KV_INT8"),
        (_env(), "window", 0, "needs cache_window"),
        (_env(), "int8", 4, "only works with"),
        (_env(), "fp8", None, "kv_mode must be one of"),
        (_env(), None, -1, "cache_window must be"),
    ]:
        with pytest.raises(ValueError, match=needle):
            resolve_kv_mode(env, mode, window)
