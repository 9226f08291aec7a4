"""The decode loop with the host one step ahead (the GPU default; forced here on the CPU): the same tokens,
stop behaviour, statistics, engine steps and cache state afterwards as the loop without it, for one row and
for batches of rows that finish at different steps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from gen_helpers import one_row

import tinyloop
from tinyloop.cache.kv import KVCache
from tinyloop.errors import NonFiniteLogitsError
from tinyloop.runtime import decode
from tinyloop.runtime.decode import Row, decode_row, decode_rows
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.stats import GenerationStats
from tinyloop.sampling import SamplingParams

PROMPT = torch.tensor(list(b"Hello, looped world"), dtype=torch.long)
PROMPTS = [list(b"Hello, looped world"), list(b"ab"), list(b"The quick brown fox"), list(b"xyz 12")]
GREEDY = SamplingParams(temperature=0.0)
MAX_SEQ = 128


@pytest.fixture(scope="module")
def model() -> Iterator[tinyloop.Model]:
    with tinyloop.Model("tiny", max_seq_len=MAX_SEQ) as m:
        yield m


@pytest.fixture(scope="module")
def engine(model: tinyloop.Model) -> Engine:
    assert not model._engine.lookahead  # the CPU default: these tests turn it on per call
    return model._engine


@dataclass
class Run:
    tokens: list[list[int]]
    reasons: list[str]
    generated: list[int]
    depths: list[list[int]]
    cache: KVCache
    steps: int  # engine.step calls
    reads: int  # readbacks of queued tokens (lookahead only)


def _count(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> dict[str, int]:
    """Counts engine.step calls and lookahead readbacks while the test runs."""
    counts = {"steps": 0, "reads": 0}
    step, take = engine.step, decode._Lookahead.take

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        counts["steps"] += 1
        return step(*args, **kwargs)

    def counted_take(self: Any, rows: Any) -> Any:
        counts["reads"] += 1
        return take(self, rows)

    monkeypatch.setattr(engine, "step", counted_step)
    monkeypatch.setattr(decode._Lookahead, "take", counted_take)
    return counts


def _rows(prompts: list[list[int]], max_tokens: list[int], stops: list[frozenset[int]], loops: list[int]) -> list[Row]:
    return [
        Row(torch.tensor(p), n, m, TokenPicker(GREEDY, None, s))
        for p, m, s, n in zip(prompts, max_tokens, stops, loops, strict=True)
    ]


def _decode(
    engine: Engine,
    counts: dict[str, int],
    lookahead: bool,
    rows: list[Row],
    finish_after: dict[int, int] | None = None,
    close_after: int | None = None,
) -> Run:
    """decode_rows over a fresh cache. finish_after {row: n}: the consumer finishes that row after its n-th
    token (as a stop string does); close_after: the consumer closes the stream after that many tokens."""
    counts.update(steps=0, reads=0)
    cache = KVCache(engine.cfg, len(rows), MAX_SEQ, max(r.loops for r in rows), engine.device, engine.dtype)
    stream = decode_rows(engine, cache, rows, lookahead=lookahead)
    seen = 0
    for b, _ in stream:
        seen += 1
        if finish_after and len(rows[b].tokens) == finish_after.get(b):
            rows[b].finish("stop_string")
        if seen == close_after:
            stream.close()
            break
    return Run([r.tokens for r in rows], [r.stats.stop_reason for r in rows], [r.stats.generated_tokens for r in rows],
               [r.step_depths for r in rows], cache, counts["steps"], counts["reads"])  # fmt: skip


def _same_cache(a: KVCache, b: KVCache) -> None:
    """Equal lengths, equal K/V at every position each row keeps, and equal logits for one more token."""
    assert torch.equal(a.lengths, b.lengths)
    for row, n in enumerate(a.lengths.tolist()):
        assert torch.equal(a.k[:, row, :, :n], b.k[:, row, :, :n])
        assert torch.equal(a.v[:, row, :, :n], b.v[:, row, :, :n])


def _same_follow_up(engine: Engine, a: KVCache, b: KVCache, loops: int) -> None:
    nxt = torch.arange(65, 65 + a.batch).view(-1, 1)
    la, lb = engine.step(nxt, a, loops, last_only=True).logits, engine.step(nxt, b, loops, last_only=True).logits
    assert la is not None and lb is not None and torch.equal(la, lb)


def _compare(engine: Engine, plain: Run, ahead: Run, loops: int) -> None:
    assert ahead.tokens == plain.tokens and ahead.reasons == plain.reasons and ahead.generated == plain.generated
    assert ahead.depths == plain.depths
    _same_cache(ahead.cache, plain.cache)
    _same_follow_up(engine, ahead.cache, plain.cache, loops)


def _single(engine: Engine, counts: dict[str, int], lookahead: bool, max_tokens: int, stops=frozenset(), take=None):  # type: ignore[no-untyped-def]
    counts.update(steps=0, reads=0)
    cache = engine.new_cache(1, MAX_SEQ, 4)
    stats = GenerationStats()
    stream = decode_row(
        engine, cache, one_row(PROMPT, max_tokens, 4, GREEDY, stats, stop_tokens=stops), lookahead=lookahead
    )
    out = []
    for tok in stream:
        out.append(tok)
        if take is not None and len(out) == take:
            stream.close()
            break
    return out, (stats.stop_reason, stats.generated_tokens, stats.finished), cache, counts["steps"], counts["reads"]


def test_one_row_same_tokens_steps_and_cache(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count(monkeypatch, engine)
    plain = _single(engine, counts, False, 24)
    ahead = _single(engine, counts, True, 24)
    assert ahead[:2] == plain[:2] and len(ahead[0]) == 24
    # One prefill and 23 decode steps either way; one readback per token.
    assert ahead[3] == plain[3] == 24 and ahead[4] == 24 and plain[4] == 0
    _same_cache(ahead[2], plain[2])
    _same_follow_up(engine, ahead[2], plain[2], 4)


def test_one_row_stop_tokens_at_every_position(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count(monkeypatch, engine)
    full = _single(engine, counts, False, 12)[0]
    for i in range(len(full)):
        stops = frozenset({full[i]})
        plain, ahead = _single(engine, counts, False, 12, stops), _single(engine, counts, True, 12, stops)
        assert ahead[:2] == plain[:2], i
        _same_cache(ahead[2], plain[2])
        # The step queued ahead of the stop token is the one extra step the stop costs (none at max_tokens).
        first = full.index(full[i])
        assert ahead[3] == plain[3] + (first + 1 < 12), i


@pytest.mark.parametrize("take", [1, 2, 7])
def test_one_row_closed_early_leaves_the_cache_like_the_plain_loop(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, take: int
) -> None:
    counts = _count(monkeypatch, engine)
    plain, ahead = _single(engine, counts, False, 16, take=take), _single(engine, counts, True, 16, take=take)
    assert ahead[:2] == plain[:2] and plain[1][0] == "closed"
    _same_cache(ahead[2], plain[2])
    _same_follow_up(engine, ahead[2], plain[2], 4)


def test_one_row_zero_and_one_tokens(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count(monkeypatch, engine)
    for n in (0, 1):
        plain, ahead = _single(engine, counts, False, n), _single(engine, counts, True, n)
        assert ahead[:2] == plain[:2] and ahead[3] == plain[3] == n
        assert torch.equal(ahead[2].lengths, plain[2].lengths)


def _plain_tokens(engine: Engine, counts: dict[str, int]) -> list[list[int]]:
    rows = _rows(PROMPTS, [10] * 4, [frozenset()] * 4, [4] * 4)
    return _decode(engine, counts, False, rows).tokens


@pytest.mark.parametrize(
    "case",
    [
        dict(max_tokens=[10, 3, 7, 1], loops=[4, 4, 4, 4]),
        dict(max_tokens=[9, 9, 9, 9], loops=[4, 2, 3, 1]),  # per-row depth
        dict(max_tokens=[10, 8, 0, 6], loops=[3, 3, 3, 3], stop_at=[2, 0, 0, 5]),  # stop tokens
        dict(max_tokens=[10, 10, 10, 10], loops=[4, 4, 4, 4], finish_after={0: 3, 2: 1, 3: 6}),  # stop strings
        dict(max_tokens=[10, 5, 10, 10], loops=[4, 4, 2, 4], stop_at=[4, 0, 0, 0], close_after=11),
    ],
)
def test_batches_same_as_the_plain_loop(engine: Engine, monkeypatch: pytest.MonkeyPatch, case: dict[str, Any]) -> None:
    counts = _count(monkeypatch, engine)
    full = _plain_tokens(engine, counts)
    stops = [frozenset({full[b][i]}) if i else frozenset() for b, i in enumerate(case.get("stop_at", [0] * 4))]

    def run(lookahead: bool) -> Run:
        rows = _rows(PROMPTS, case["max_tokens"], stops, case["loops"])
        return _decode(engine, counts, lookahead, rows, case.get("finish_after"), case.get("close_after"))

    plain, ahead = run(False), run(True)
    _compare(engine, plain, ahead, max(case["loops"]))
    assert ahead.reads >= 1 and plain.reads == 0
    # At most one extra step (the one queued ahead of the last row's end).
    assert plain.steps <= ahead.steps <= plain.steps + 1


def test_rows_that_need_host_decisions_run_without_lookahead(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count(monkeypatch, engine)
    picker = TokenPicker(SamplingParams(temperature=0.7, seed=3), None, frozenset())
    sampled = Row(torch.tensor(PROMPTS[0]), 4, 5, picker)
    greedy = _rows(PROMPTS[1:2], [5], [frozenset()], [4])
    run = _decode(engine, counts, True, [sampled, *greedy])
    assert run.reads == 0 and all(len(t) == 5 for t in run.tokens)


@pytest.mark.parametrize("bad", [0, 3])
def test_non_finite_logits_raise_for_that_call(engine: Engine, monkeypatch: pytest.MonkeyPatch, bad: int) -> None:
    full = _single(engine, _count(monkeypatch, engine), False, 8)[0]
    step = engine.step
    calls = [0]

    def poisoned(*args: Any, **kwargs: Any) -> Any:  # step `bad` (0: the prefill) gives NaN logits for row 0
        out = step(*args, **kwargs)
        if calls[0] == bad:
            with torch.inference_mode():
                out.logits[0, -1, 7] = float("nan")
        calls[0] += 1
        return out

    monkeypatch.setattr(engine, "step", poisoned)
    for lookahead in (False, True):
        calls[0] = 0
        got: list[int] = []
        with pytest.raises(NonFiniteLogitsError):
            cache = engine.new_cache(1, MAX_SEQ, 4)
            for tok in decode_row(engine, cache, one_row(PROMPT, 8, 4, GREEDY), lookahead=lookahead):
                got.append(tok)
        assert got == full[:bad], lookahead


def test_generate_batch_with_stop_strings_same_with_lookahead() -> None:
    prompts = [list(b"Hello"), list(b"a longer prompt here"), list(b"xy")]
    kw: dict[str, Any] = dict(max_tokens=[12, 5, 9], loops=[3, 2, 3], temperature=0.0, stop=[["e "], [], ["a", "zz"]],
                              stop_tokens=[[], [101], []])  # fmt: skip
    with tinyloop.Model("tiny", max_seq_len=64) as plain, tinyloop.Model("tiny", max_seq_len=64) as ahead:
        ahead._engine.lookahead = True
        want = [t.tolist() for t in plain.generate_batch(prompts, **kw)]
        assert [t.tolist() for t in ahead.generate_batch(prompts, **kw)] == want
        assert [s.stop_reason for s in ahead.last_batch_stats] == [s.stop_reason for s in plain.last_batch_stats]
        one = dict(max_tokens=12, loops=3, temperature=0.0, stop=["e "])
        assert ahead.generate(prompts[0], **one).tolist() == plain.generate(prompts[0], **one).tolist()


def test_a_step_that_fails_while_queued_ahead_raises_its_own_error(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises after the host has queued ahead surfaces its error (not the loop's cleanup of the
    position it never fed)."""
    step, calls = engine.step, {"n": 0}

    def failing_second_step(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the first step queued ahead
            raise ValueError("the kernel refused the rows")
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", failing_second_step)
    rows = _rows(PROMPTS[:2], [8, 8], [frozenset()] * 2, [4, 4])
    with pytest.raises(ValueError, match="the kernel refused the rows"):
        _decode(engine, {"steps": 0, "reads": 0}, True, rows)
