"""PrefixPool: longest-prefix matches (shorter and longer entries) are exact, the budget always holds,
the counters add up, check_integrity() catches broken state, and pools survive a trip to disk."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from functools import cached_property

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tinyloop
from tinyloop.api.model import Model
from tinyloop.cache import pool_file
from tinyloop.cache.pool import PrefixPool, content_key
from tinyloop.errors import PrefixPoolFormatError

SYSTEM = np.arange(30, 60, dtype=np.int32)


def _greedy(m: Model, tokens: np.ndarray, loops: int = 2, n: int = 8) -> list[int]:
    return m.generate(tokens, max_tokens=n, loops=loops, temperature=0.0).tolist()


@pytest.mark.parametrize("mode", ["16bit", "int8", "hidden", "window"])
def test_pool_matches_shorter_longer_and_exact_entries(models, mode: str) -> None:
    m = models[mode]
    pool = tinyloop.PrefixPool(max_bytes=1 << 26, max_entries=8)
    long_entry = np.concatenate([SYSTEM, [1, 2, 3, 4, 5]]).astype(np.int32)
    m.register_prefix(pool, m.build_prefix_cache(SYSTEM[:20], loops=2))
    m.register_prefix(pool, m.build_prefix_cache(long_entry, loops=2))
    prompts = {
        "extends the long entry": np.concatenate([long_entry, [9, 9]]),
        "exactly the long entry": long_entry,
        "inside the long entry": SYSTEM[:26],
        "diverges inside the long entry": np.concatenate([SYSTEM, [1, 2, 77]]),
        "diverges before any entry ends": np.concatenate([SYSTEM[:10], [3]]),
        "shares nothing": np.array([200, 201], dtype=np.int32),
    }
    for what, prompt in prompts.items():
        before = pool.stats()
        got = m.generate_with_pool(pool, prompt, max_tokens=8, loops=2, temperature=0.0).tolist()
        assert got == _greedy(m, prompt), what
        hit = pool.stats()["hits"] > before["hits"]
        # Truncating an entry is exact in every mode but a sliding window whose ring already wrapped.
        assert hit == (what != "shares nothing" and (mode != "window" or what != "diverges before any entry ends"))
    pool.check_integrity()


def test_match_choice_and_reuse_lengths(models) -> None:
    m = models["16bit"]
    pool = PrefixPool()
    short = m.build_prefix_cache(SYSTEM[:10], loops=2)
    long = m.build_prefix_cache(SYSTEM, loops=2)
    pool.register(short)
    pool.register(long)
    ident = m.cache_identity
    assert pool.lookup(SYSTEM, 2, ident) == tinyloop_match(long, 30, True)
    assert pool.lookup(SYSTEM[:20], 2, ident) == tinyloop_match(long, 19, False)  # truncated, last token recomputed
    assert pool.lookup(np.concatenate([SYSTEM[:15], [0]]), 2, ident) == tinyloop_match(long, 15, False)
    refuse_truncation = pool.lookup(SYSTEM[:20], 2, ident, usable=lambda length, use: use == length)
    assert refuse_truncation == tinyloop_match(short, 10, False)
    assert pool.lookup(SYSTEM, 3, ident) is None  # other loop count: another address
    assert pool.register(long) == long.key and len(pool) == 2  # registering twice only touches it
    assert long.key == content_key(ident, 2, SYSTEM)


def tinyloop_match(item: object, reuse: int, exact: bool) -> object:
    from tinyloop.cache.pool import PoolMatch

    return PoolMatch(item, reuse, exact)


def test_pool_refuses_caches_of_another_model_or_mode(models) -> None:
    pool = PrefixPool()
    models["16bit"].register_prefix(pool, models["16bit"].build_prefix_cache(SYSTEM, loops=2))
    other = models["int8"].build_prefix_cache(SYSTEM, loops=2)
    with pytest.raises(ValueError, match="one pool per model"):
        pool.register(other)
    with pytest.raises(ValueError, match="one per model"):
        models["int8"].generate_with_pool(pool, SYSTEM, 2, 2)
    with pytest.raises(ValueError, match="kv_mode 'none'"):
        models["none"].generate_with_pool(pool, SYSTEM, 2, 2)


def test_byte_budget_evicts_least_recently_used(models) -> None:
    m = models["16bit"]
    caches = [m.build_prefix_cache(SYSTEM[i : i + 10], loops=1) for i in range(4)]  # equal sizes
    pool = PrefixPool(max_bytes=2 * caches[0].nbytes + 16, max_entries=10)
    for c in caches[:3]:
        pool.register(c)
    assert caches[0] not in pool  # the budget only fits two of these
    assert pool.lookup(SYSTEM[1:11], 1).item is caches[1]  # now the most recently used
    pool.register(caches[3])
    assert caches[1] in pool and caches[2] not in pool and caches[3] in pool
    assert pool.nbytes <= pool.max_bytes and pool.stats()["evictions"] == 2
    with pytest.raises(ValueError, match="exceeds the pool's max_bytes"):
        PrefixPool(max_bytes=100).register(caches[0])
    pool.check_integrity()


def test_save_and_load_round_trip(models, tmp_path) -> None:
    m = models["int8"]
    pool = PrefixPool(max_bytes=1 << 24, max_entries=5)
    for n in (12, 20, 30):
        m.register_prefix(pool, m.build_prefix_cache(SYSTEM[:n], loops=2))
    pool.lookup(SYSTEM[:12], 2)  # LRU order: 20, 30, 12
    path = tmp_path / "pool.safetensors"
    pool.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["pool.safetensors"]  # no temporary left behind
    loaded = PrefixPool.load(path, m)
    assert [len(c.tokens) for c in loaded.entries()] == [20, 30, 12]
    assert (loaded.max_bytes, loaded.max_entries) == (1 << 24, 5)
    loaded.check_integrity()
    prompt = np.concatenate([SYSTEM[:25], [4, 4]])
    assert m.generate_with_pool(loaded, prompt, 6, 2, temperature=0.0).tolist() == _greedy(m, prompt, n=6)
    assert loaded.stats()["hits"] == 1
    with pytest.raises(PrefixPoolFormatError, match="'model_key'.* rebuild it with this model"):
        PrefixPool.load(path, models["16bit"])
    (tmp_path / "junk.safetensors").write_bytes(b"not a pool")
    with pytest.raises(ValueError, match="prefix pool file"):
        PrefixPool.load(tmp_path / "junk.safetensors", m)


def test_a_failed_save_keeps_the_previous_file(models, tmp_path, monkeypatch) -> None:
    m = models["16bit"]
    pool = PrefixPool()
    pool.register(m.build_prefix_cache(SYSTEM[:8], loops=1))
    path = tmp_path / "pool.safetensors"
    pool.save(path)
    before = path.read_bytes()
    pool.register(m.build_prefix_cache(SYSTEM[:9], loops=1))

    def boom(tensors: object, filename: str, metadata: object = None) -> None:
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pool_file, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        pool.save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["pool.safetensors"]


# ---- the pool's bookkeeping under random operations (fake caches: no model needed) -------------
@dataclasses.dataclass(eq=False)
class FakeCache:
    tokens: np.ndarray
    loops: int
    nbytes: int
    model_key: str = "fake"
    closed: bool = False

    @cached_property
    def key(self) -> str:
        return content_key(self.model_key, self.loops, self.tokens)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=10).map(lambda x: np.array(x, dtype=np.int32))


class PoolMachine(RuleBasedStateMachine):
    """Mirrors the pool with a plain LRU list and checks every lookup against a brute-force search."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PrefixPool(max_bytes=1000, max_entries=6)
        self.model: OrderedDict[str, FakeCache] = OrderedDict()

    @rule(tokens=token_lists, loops=st.integers(1, 2), nbytes=st.integers(1, 400))
    def register(self, tokens: np.ndarray, loops: int, nbytes: int) -> None:
        item = FakeCache(tokens, loops, nbytes)
        self.pool.register(item)
        if item.key in self.model:
            self.model.move_to_end(item.key)
            return
        while self.model and (sum(c.nbytes for c in self.model.values()) + nbytes > 1000 or len(self.model) >= 6):
            self.model.popitem(last=False)
        self.model[item.key] = item

    @rule(tokens=token_lists, loops=st.integers(1, 2))
    def lookup(self, tokens: np.ndarray, loops: int) -> None:
        got = self.pool.lookup(tokens, loops)
        same = [c for c in self.model.values() if c.loops == loops]
        n = len(tokens)
        best = max((_common(c.tokens, tokens) for c in same), default=0)
        exact = any(c.tokens.tolist() == tokens.tolist() for c in same)
        want = n if exact else min(best, n - 1)
        if want == 0:
            assert got is None
            return
        assert got is not None and got.reuse == want and got.exact == exact
        assert _common(got.item.tokens, tokens) >= got.reuse
        self.model.move_to_end(got.item.key)

    @precondition(lambda self: len(self.model) > 0)
    @rule(index=st.integers(0, 100))
    def remove(self, index: int) -> None:
        key = list(self.model)[index % len(self.model)]
        assert self.pool.remove(key)
        del self.model[key]

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        assert self.pool.nbytes <= self.pool.max_bytes
        assert [e.key for e in self.pool.entries()] == list(self.model)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_check_integrity_catches_broken_state() -> None:
    pool = PrefixPool(max_bytes=100)
    for toks in ([1, 2, 3], [1, 2, 4], [1, 5]):
        pool.register(FakeCache(np.array(toks, dtype=np.int32), 1, 10))
    pool.check_integrity()
    pool._bytes += 1
    with pytest.raises(AssertionError, match="bytes"):
        pool.check_integrity()
    pool._bytes -= 1
    node = pool._trees[1].root.children[np.array([1], dtype="<i4").tobytes()]
    node.label = node.label + b"\x00\x00\x00\x00"  # the path no longer spells the entries' tokens
    with pytest.raises(AssertionError, match="tokens differ"):
        pool.check_integrity()


def test_ten_thousand_entries_stay_correct() -> None:
    rng = np.random.default_rng(0)
    pool = PrefixPool(max_bytes=1 << 40, max_entries=10_000)
    system = rng.integers(0, 256, 200).astype(np.int32)
    items = [FakeCache(np.concatenate([system, rng.integers(0, 256, 8)]).astype(np.int32), 1, 1) for _ in range(10_000)]
    for item in items:
        pool.register(item)
    for item in items[::997]:
        got = pool.lookup(np.concatenate([item.tokens, [1]]), 1)
        assert got is not None and got.item is item and got.reuse == 208
    assert len(pool) == 10_000
    pool.check_integrity()
