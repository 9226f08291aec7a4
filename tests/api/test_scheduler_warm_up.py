"""Scheduler.warm_up: a batched decode step of every batch size at the default loops, started or not, and no
trace afterwards (slots free, prefix pool untouched, stats as before); refused on a busy scheduler."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tinyloop
import tinyloop.runtime.scheduler as slot_scheduler
from helpers import models_per_kv_mode
from tinyloop.runtime.warm_up import decode_buckets

KV_MODES = {"16bit": 0, "window": 8, "none": 0}
BUCKETS = {8: (8, 4, 2, 1), 6: (6, 4, 2, 1), 1: (1,)}
AFTER = (list(b"Hello there"), dict(max_tokens=6, temperature=0.0))


@pytest.fixture(scope="module")
def models(tiny_files) -> Iterator[dict[str, tinyloop.Model]]:
    with models_per_kv_mode(tiny_files["f32"], KV_MODES) as opened:
        yield opened


def record_decode_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(rows stepped, rows live, loops) of every decode step the schedulers run from now on."""
    steps: list[tuple[int, int, int]] = []
    decode_step = slot_scheduler.decode_step

    def recording(engine, cache, rows, loops, feed=None):  # type: ignore[no-untyped-def]
        steps.append((len(rows), sum(r is not None and not r.done for r in rows), loops))
        return decode_step(engine, cache, rows, loops, feed)

    monkeypatch.setattr(slot_scheduler, "decode_step", recording)
    return steps


def fully_live(steps: list[tuple[int, int, int]]) -> set[int]:
    return {rows for rows, live, _ in steps if live == rows}


def test_decode_buckets_are_the_step_sizes_of_every_last_live_row() -> None:
    assert [decode_buckets(b) for b in (1, 2, 3, 6, 8, 9)] == [
        [1], [2, 1], [3, 2, 1], [6, 4, 2, 1], [8, 4, 2, 1], [9, 8, 4, 2, 1]
    ]  # fmt: skip


@pytest.mark.parametrize("started", [False, True], ids=["stepped", "started"])
@pytest.mark.parametrize("max_batch", sorted(BUCKETS))
@pytest.mark.parametrize("mode", sorted(KV_MODES))
def test_warm_up_steps_every_batch_size_and_leaves_no_trace(models, monkeypatch, mode, max_batch, started) -> None:
    m = models[mode]
    steps = record_decode_steps(monkeypatch)
    pool = tinyloop.PrefixPool(1 << 20)
    s = tinyloop.Scheduler(m, max_batch=max_batch, prefix_pool=pool)
    if started:
        s.start()
    before = s.stats()
    report = s.warm_up()
    loops = m.header.config.default_loops
    assert (report.buckets, report.loops, report.requests) == (BUCKETS[max_batch], (4,), sum(BUCKETS[max_batch]) + 2)
    assert report.seconds > 0
    # Each batch size had a step with every one of its rows live, all at the default loops.
    assert fully_live(steps) == set(BUCKETS[max_batch])
    assert {at for _, _, at in steps} == {loops}
    assert set(s.decoded_buckets) == {(rows, loops) for rows in BUCKETS[max_batch]}
    assert s.stats() == before
    assert s._rows == [None] * max_batch
    assert (s.prefix is None) == (mode == "none")  # the pool's hooks are back
    if s.slots is not None:
        assert int(s.slots.lengths.sum()) == 0
        s.slots.check_integrity()
    assert len(pool) == 0 and pool.nbytes == 0
    prompt, kw = AFTER
    handle = s.submit(prompt, **kw)
    s.stop(drain=True)
    assert handle.result(timeout=60).tolist() == m.generate(prompt, **kw).tolist()
    assert s.stats()["finished"] == 1 and s.stats()["prompt_tokens"] == len(prompt)
    assert len(pool) == (0 if mode == "none" else 1)  # the pool still takes the requests' prompts


@pytest.mark.parametrize("started", [False, True], ids=["stepped", "started"])
def test_warm_up_at_several_depths_steps_every_batch_size_at_each(models, monkeypatch, started) -> None:
    m = models["16bit"]
    steps = record_decode_steps(monkeypatch)
    s = tinyloop.Scheduler(m, max_batch=4, max_loops=8)
    if started:
        s.start()
    report = s.warm_up([6, 2, 6])  # a depth named twice is warmed up once
    assert (report.buckets, report.loops, report.requests) == ((4, 2, 1), (6, 2), 2 * (4 + 2 + 1 + 2))
    for depth in (6, 2):
        assert {rows for rows, live, at in steps if live == rows and at == depth} == {4, 2, 1}
    assert set(s.decoded_buckets) == {(rows, depth) for rows in (4, 2, 1) for depth in (6, 2)}
    assert s.stats()["finished"] == 0 and s._rows == [None] * 4
    prompt, kw = AFTER
    handle = s.submit(prompt, **{**kw, "loops": 2})
    s.stop(drain=True)
    assert handle.result(timeout=60).tolist() == m.generate(prompt, **{**kw, "loops": 2}).tolist()


@pytest.mark.parametrize(
    ("loops", "message"),
    [([9], r"warm_up loops \[9\] exceed this scheduler's max_loops \(8\)"), ([], "at least one depth"),
     (0, "must be a positive integer, got 0"), ([2, True], "got True"), ("4", "got '4'")],
)  # fmt: skip
def test_warm_up_refuses_depths_it_cannot_run(models, loops, message) -> None:
    s = tinyloop.Scheduler(models["16bit"], max_batch=2, max_loops=8)
    with pytest.raises(ValueError, match=message):
        s.warm_up(loops)
    assert s.warm_up(8).loops == (8,)  # nothing ran, nothing left behind


def test_warm_up_refuses_a_busy_scheduler_and_submissions_while_it_runs(models, monkeypatch) -> None:
    m = models["16bit"]
    s = tinyloop.Scheduler(m, max_batch=2)
    waiting = s.submit([1, 2, 3], max_tokens=4, temperature=0.0)
    with pytest.raises(RuntimeError, match="idle scheduler, but 0 requests are running and 1 waiting"):
        s.warm_up()
    s.step()
    with pytest.raises(RuntimeError, match="idle scheduler, but 1 requests are running and 0 waiting"):
        s.warm_up()
    while not waiting.done:
        s.step()
    run_wave = s._run_wave
    refused: list[str] = []

    def submitting_meanwhile(wave):  # type: ignore[no-untyped-def]
        with pytest.raises(RuntimeError, match="warming up") as caught:
            s.submit([5], max_tokens=2)
        refused.append(str(caught.value))
        run_wave(wave)

    monkeypatch.setattr(s, "_run_wave", submitting_meanwhile)
    assert s.warm_up().buckets == (2, 1)
    assert len(refused) == 3  # one per wave: batch sizes 2 and 1, then the prefill wave
    assert s.stats()["finished"] == 1
    s.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        s.warm_up()


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_wave_admitted_over_several_steps_still_decodes_together(models, monkeypatch, chunk: int) -> None:
    steps = record_decode_steps(monkeypatch)
    s = tinyloop.Scheduler(models["16bit"], max_batch=8, prefill_chunk_tokens=chunk)  # < max_batch prompts a step
    assert s.warm_up().buckets == (8, 4, 2, 1)
    assert fully_live(steps) == {8, 4, 2, 1}


def test_warm_up_needs_room_for_a_decode_step(models) -> None:
    s = tinyloop.Scheduler(models["16bit"], max_batch=4, max_seq_len=2)
    with pytest.raises(ValueError, match="max_seq_len >= 3"):
        s.warm_up()


@pytest.mark.parametrize("started", [False, True], ids=["stepped", "started"])
def test_a_failing_warm_up_raises_and_the_scheduler_still_serves(models, monkeypatch, started) -> None:
    m = models["16bit"]
    s = tinyloop.Scheduler(m, max_batch=4)
    if started:
        s.start()
    before = s.stats()

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a broken kernel")

    monkeypatch.setattr(slot_scheduler, "decode_step", broken)
    with pytest.raises(RuntimeError, match="a warm-up request ended with 'error': a broken kernel"):
        s.warm_up()
    monkeypatch.undo()
    assert s.stats() == before and s._rows == [None] * 4
    prompt, kw = AFTER
    handle = s.submit(prompt, **kw)
    s.stop(drain=True)
    assert handle.result(timeout=60).tolist() == m.generate(prompt, **kw).tolist()
