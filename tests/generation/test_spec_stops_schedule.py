"""Speculative decoding stops exactly as plain decoding (stop tokens, stop strings, grammar + stop tokens),
and the depth schedule combined with speculation and with the sliding-window cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gen_helpers import PROMPTS, one_row, tiny_engine

from tinyloop.api.model import Model
from tinyloop.cache.factory import KVModeChoice, make_cache
from tinyloop.cache.kv import KVCache
from tinyloop.model.layers import StepContext
from tinyloop.runtime.decode import decode_row
from tinyloop.runtime.depth_schedule import DepthSchedule
from tinyloop.runtime.speculative import SpecConfig, SpeculativeStats, speculative_tokens
from tinyloop.runtime.stats import GenerationStats
from tinyloop.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tiny_files):
    with Model(tiny_files["f32"], max_seq_len=256) as m:
        yield m


def _plain(engine, ids, n, loops, **kw) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    out = list(decode_row(engine, engine.new_cache(1, 128, loops), one_row(ids, n, loops, GREEDY, stats, **kw)))
    return out, stats


def _spec(engine, ids, n, draft, verify, adaptive=False, **kw) -> tuple[list[int], SpeculativeStats]:
    stats = SpeculativeStats()
    spec = SpecConfig(draft, verify, 4, adaptive=adaptive)
    out = list(speculative_tokens(engine, engine.new_cache(1, 128, verify), ids, n, spec, GREEDY, stats, **kw))
    return out, stats


@pytest.mark.parametrize("draft, verify", [(1, 4), (2, 8)])
def test_stop_tokens_end_speculation_where_plain_decoding_ends(draft, verify) -> None:
    """Every token of the plain output in turn as the stop token: drafted, corrected and bonus stops."""
    engine = tiny_engine(contractive=0.05)  # drafts often right: stop tokens land inside accepted runs too
    ids = torch.tensor(list(PROMPTS[1]))
    full, _ = _plain(engine, ids, 30, verify)
    drafted = accepted = 0
    for stop in sorted(set(full)):
        plain, pstats = _plain(engine, ids, 30, verify, stop_tokens=frozenset({stop}))
        got, stats = _spec(engine, ids, 30, draft, verify, stop_tokens=frozenset({stop}))
        assert got == plain == full[: full.index(stop)], stop
        assert stats.stop_reason == pstats.stop_reason == "stop_token"
        assert stats.generated_tokens == len(got)
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


def test_stop_tokens_and_strings_through_the_api(model) -> None:
    prompt = list(b"Hello")
    full = model.generate(prompt, 40, 4, temperature=0)
    stop = int(full[12])
    plain = model.generate(prompt, 40, 4, temperature=0, stop_tokens=[stop])
    res = model.generate_speculative(prompt, 40, 1, 4, stop_tokens=[stop])
    np.testing.assert_array_equal(res.tokens, plain)
    assert res.stats.stop_reason == "stop_token" and stop not in res.tokens.tolist()
    text = bytes(full.tolist())
    for a, b in ((0, 1), (5, 8), (17, 20), (30, 34)):
        s = text[a:b]
        plain = model.generate(prompt, 40, 4, temperature=0, stop=[s])
        assert model.last_stats.stop_reason == "stop_string"
        for adaptive in (True, False):
            res = model.generate_speculative(prompt, 40, 1, 4, stop=[s], adaptive=adaptive)
            np.testing.assert_array_equal(res.tokens, plain)
            assert bytes(res.tokens.tolist()) == text[: text.find(s)]
            assert res.stats.stop_reason == "stop_string"
        pieces = list(model.generate_speculative_stream(prompt, 40, 1, 4, stop=[s], text=True))
        assert "".join(p.text for p in pieces) == text[: text.find(s)].decode("utf-8", "replace")
        assert model.last_speculative_stats.stop_reason == "stop_string"
    # A stop string that never occurs: the whole output, stop_reason max_tokens.
    res = model.generate_speculative(prompt, 40, 1, 4, stop=["\x00\x01\x02"])
    np.testing.assert_array_equal(res.tokens, full)
    assert res.stats.stop_reason == "max_tokens"


def test_speculative_stream_closes_early(model) -> None:
    stream = model.generate_speculative_stream(list(b"Hi"), 30, 1, 4)
    first = [next(stream) for _ in range(3)]
    stream.close()
    assert first == model.generate(list(b"Hi"), 3, 4, temperature=0).tolist()
    assert model.last_speculative_stats.stop_reason == "closed"


def test_sampled_speculation_never_emits_a_stop_token(model) -> None:
    for seed in range(4):
        full = model.generate_speculative(list(b"Hi there"), 40, 1, 4, temperature=1.0, top_k=0, seed=seed)
        stop = int(full.tokens[len(full.tokens) // 2])
        res = model.generate_speculative(
            list(b"Hi there"), 40, 1, 4, temperature=1.0, top_k=0, seed=seed, stop_tokens=[stop]
        )  # fmt: skip
        assert stop not in res.tokens.tolist()
        assert res.stats.stop_reason in ("stop_token", "max_tokens")


def test_grammar_with_stop_tokens_greedy_identity(model) -> None:
    """Under a grammar, stop tokens are allowed only where the text fully matches: same end as plain."""
    for pattern in (r"[a-z]{2,12}", r"[0-9]+(\.[0-9]+)?"):
        for stop in (10, 32):
            plain = model.generate(list(b"x"), 20, 4, temperature=0, grammar=pattern, stop_tokens=[stop])
            res = model.generate_speculative(list(b"x"), 20, 1, 4, grammar=pattern, stop_tokens=[stop])
            np.testing.assert_array_equal(res.tokens, plain)
            assert res.stats.stop_reason == model.last_stats.stop_reason


@pytest.mark.parametrize("draft, verify", [(1, 4), (2, 8)])
@pytest.mark.parametrize("warmup, shallow", [(3, 1), (6, 2), (40, 1)])
def test_depth_schedule_with_speculation_equals_plain_schedule(draft, verify, warmup, shallow) -> None:
    engine = tiny_engine(contractive=0.05)
    for prompt in PROMPTS[:2]:
        ids = torch.tensor(list(prompt))
        schedule = DepthSchedule(warmup, shallow)
        plain, _ = _plain(engine, ids, 24, verify, schedule=schedule)
        for adaptive in (False, True):
            got, stats = _spec(engine, ids, 24, draft, verify, adaptive, schedule=schedule)
            assert got == plain
            assert stats.warmup_steps == min(warmup, 23)


def test_depth_schedule_with_speculation_api_and_stop_string(model) -> None:
    prompt = list(b"The meaning of life is")
    plain = model.generate(prompt, 30, 8, temperature=0, l_warmup_tokens=5, l_warmup_loops=2)
    res = model.generate_speculative(prompt, 30, 2, 8, l_warmup_tokens=5, l_warmup_loops=2)
    np.testing.assert_array_equal(res.tokens, plain)
    assert res.stats.warmup_steps == 5
    s = bytes(plain.tolist())[8:10]
    plain = model.generate(prompt, 30, 8, temperature=0, l_warmup_tokens=5, l_warmup_loops=2, stop=[s])
    res = model.generate_speculative(prompt, 30, 2, 8, l_warmup_tokens=5, l_warmup_loops=2, stop=[s])
    np.testing.assert_array_equal(res.tokens, plain)
    with pytest.raises(ValueError, match="l_warmup_loops"):
        model.generate_speculative(prompt, 5, 2, 8, l_warmup_tokens=3, l_warmup_loops=9)


class _MaskedFullCache:
    """Reference for the sliding window: a full cache whose attention is limited to the last `window`
    positions (the window mode's definition), with positions at their own index (so the depth schedule's
    positional fill applies unchanged)."""

    def __init__(self, engine, max_seq: int, loops: int, window: int) -> None:
        self.inner = KVCache(engine.cfg, 1, max_seq, loops, torch.device("cpu"), engine.dtype)
        self.cfg, self.loops, self.max_seq, self.window = engine.cfg, loops, max_seq, window

    @property
    def lengths(self) -> torch.Tensor:
        return self.inner.lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        self.inner.lengths = value

    def _positional(self) -> dict[str, tuple[torch.Tensor, int]]:
        return {"k": (self.inner.k, 3), "v": (self.inner.v, 3)}

    def begin_step(self, positions: torch.Tensor, start: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        span = torch.arange(int(positions.max()) + 1)
        q = positions[:, :, None]
        return ((span <= q) & (span > q - self.window)).unsqueeze(1)

    def update(self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext):
        return self.inner.update(slot, k, v, ctx)

    def truncate(self, length) -> None:
        self.inner.truncate(length)


@pytest.mark.parametrize("window", [2, 5, 9])
@pytest.mark.parametrize("warmup, shallow", [(4, 1), (12, 2)])
def test_depth_schedule_with_sliding_window_equals_masked_full_cache(window, warmup, shallow) -> None:
    engine = tiny_engine()
    loops, n = 4, 24
    schedule = DepthSchedule(warmup, shallow)
    for prompt in PROMPTS[:2]:
        ids = torch.tensor(list(prompt))
        ring = make_cache(KVModeChoice("window", window), engine.cfg, 1, 128, loops, torch.device("cpu"), engine.dtype)
        got = list(decode_row(engine, ring, one_row(ids, n, loops, GREEDY, schedule=schedule)))
        ring.check_integrity()
        ref_cache = _MaskedFullCache(engine, 128, loops, window)
        ref = list(decode_row(engine, ref_cache, one_row(ids, n, loops, GREEDY, schedule=schedule)))  # type: ignore[arg-type]
        assert got == ref
        # Both hold the same K/V for the positions still in the ring.
        end = int(ring.lengths[0])
        for p in range(max(0, end - window), end):
            torch.testing.assert_close(ring.k[:, :, :, p % window], ref_cache.inner.k[:, :, :, p])


def test_depth_schedule_with_a_window_wider_than_the_text_equals_the_full_cache(tiny_files) -> None:
    kw = dict(temperature=0, l_warmup_tokens=6, l_warmup_loops=1)
    with Model(tiny_files["f32"], max_seq_len=128) as full, Model(tiny_files["f32"], 128, cache_window=64) as win:
        for prompt in PROMPTS[:2]:
            np.testing.assert_array_equal(
                win.generate(list(prompt), 30, 4, **kw), full.generate(list(prompt), 30, 4, **kw)
            )


def test_speculation_refuses_a_sliding_window_cache(tiny_files) -> None:
    with Model(tiny_files["f32"], max_seq_len=128, cache_window=16) as m:
        with pytest.raises(ValueError, match="sliding-window"):
            m.generate_speculative(list(b"Hello"), 10, 1, 4)
