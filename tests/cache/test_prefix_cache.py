"""Prefix caches: generation continues without recomputing the prefix and equals a fresh run, in every mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import max_rel_error
from tinyloop.api.handles import PrefixCache

PREFIX = np.arange(40, 71, dtype=np.int32)  # 31 tokens: longer than the window fixture's 6 positions
SUFFIX = np.array([5, 99, 7], dtype=np.int32)
CACHED_MODES = ["16bit", "int8", "hidden", "window"]
# A fresh run computes the prefix's K/V in a GEMM of more rows than the cache did, so a value a last float bit
# apart can round to the neighbouring INT8 step (1/127 of its head's largest): the logits then move by ~1e-4.
LOGITS_TOLERANCE = {"16bit": 1e-5, "int8": 1e-3, "hidden": 1e-5, "window": 1e-5}


@pytest.mark.parametrize("mode", CACHED_MODES)
def test_greedy_generation_equals_a_fresh_run(models, mode: str) -> None:
    m = models[mode]
    pc = m.build_prefix_cache(PREFIX, loops=3)
    assert isinstance(pc, PrefixCache) and pc.loops == 3 and pc.tokens.tolist() == PREFIX.tolist()
    fresh = m.generate(np.concatenate([PREFIX, SUFFIX]), max_tokens=12, loops=3, temperature=0.0)
    for _ in range(2):  # an immutable snapshot: a second generation starts from the same state
        got = m.generate_from_prefix_cache(pc, SUFFIX, max_tokens=12, loops=3, temperature=0.0)
        assert got.tolist() == fresh.tolist()
    assert m.last_stats.prompt_tokens == PREFIX.size + SUFFIX.size
    empty = m.generate_from_prefix_cache(pc, [], max_tokens=5, temperature=0.0)
    assert empty.tolist() == m.generate(PREFIX, max_tokens=5, loops=3, temperature=0.0).tolist()


@pytest.mark.parametrize("mode", ["16bit", "int8"])
def test_seeded_sampling_equals_a_fresh_run(models, mode: str) -> None:
    m = models[mode]
    pc = m.build_prefix_cache(PREFIX, loops=2)
    fresh = m.generate(np.concatenate([PREFIX, SUFFIX]), 10, 2, temperature=0.9, top_k=20, top_p=0.9, seed=11)
    got = m.generate_from_prefix_cache(pc, SUFFIX, 10, 2, temperature=0.9, top_k=20, top_p=0.9, seed=11)
    assert got.tolist() == fresh.tolist()


@pytest.mark.parametrize("mode", CACHED_MODES)
def test_logits_equal_a_fresh_run(models, mode: str) -> None:
    m = models[mode]
    pc = m.build_prefix_cache(PREFIX, loops=3)
    engine = m._engine
    with m._request_cache(3) as fresh:
        fresh.truncate(0)
        want = engine.step(torch.from_numpy(np.concatenate([PREFIX, SUFFIX]).astype(np.int64))[None], fresh, 3)
        want = want.logits[0]
    assert max_rel_error(pc.last_logits(), want[PREFIX.size - 1]) <= LOGITS_TOLERANCE[mode]
    with m._request_cache(3) as working:
        working.restore(pc.kv(), PREFIX.size, 3, PREFIX.size)
        got = engine.step(torch.from_numpy(SUFFIX.astype(np.int64))[None], working, 3).logits[0]
    assert max_rel_error(got, want[PREFIX.size :]) <= LOGITS_TOLERANCE[mode]


def test_a_snapshot_holds_only_the_prefix_positions(models) -> None:
    m = models["16bit"]
    pc = m.build_prefix_cache(PREFIX, loops=2)
    kv = pc.kv()
    assert kv is not None and kv["k"].shape[2] == PREFIX.size  # [slots, kv_heads, T, hd]
    assert pc.nbytes == sum(t.nbytes for t in kv.values()) + pc.last_logits().nbytes + PREFIX.nbytes
    assert pc.nbytes < m._cache_bytes()  # the working cache spans max_seq_len


def test_loops_mismatch_and_argument_errors(models) -> None:
    m = models["16bit"]
    pc = m.build_prefix_cache(PREFIX, loops=3)
    with pytest.raises(RuntimeError, match=r"^loops mismatch: .*loops=3"):
        m.generate_from_prefix_cache(pc, SUFFIX, 4, loops=2)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        m.generate_from_prefix_cache(pc, SUFFIX, 90)
    with pytest.raises(ValueError, match="must not be empty"):
        m.build_prefix_cache([])
    with pytest.raises(ValueError, match="another model|this model is"):
        models["int8"].generate_from_prefix_cache(pc, SUFFIX, 2)
    with pytest.raises(TypeError, match="PrefixCache"):
        m.generate_from_prefix_cache("not a cache", SUFFIX, 2)  # type: ignore[arg-type]


def test_mode_none_refuses_prefix_caches_with_the_fix(models) -> None:
    with pytest.raises(ValueError, match="kv_mode 'none'.*another kv_mode"):
        models["none"].build_prefix_cache(PREFIX)
