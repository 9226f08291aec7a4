"""Scheduler (continuous batching): every request gives what `Model.generate` gives alone with the same
arguments, whenever it joins; aborts free slots; the prefix pool; threads; a full queue; stop()."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import tinyloop
from helpers import models_per_kv_mode
from tinyloop.errors import NonFiniteLogitsError

KV_MODES = {"16bit": 0, "int8": 0, "hidden": 0, "window": 8, "none": 0}

REQUESTS = [
    (list(b"Hello there"), dict(max_tokens=7, temperature=0.0)),
    (list(b"abc"), dict(max_tokens=5, loops=2, temperature=0.9, seed=11, top_k=5)),
    (list(b"The value of x is"), dict(max_tokens=6, loops=4, temperature=0.0, stop=["e "])),
    (list(b"n="), dict(max_tokens=6, temperature=0.0, grammar=r"[0-9]{1,4}")),
    (list(b"q"), dict(max_tokens=8, loops=3, temperature=1.2, seed=5, top_p=0.8, stop_tokens=[101])),
    (list(range(40, 70)), dict(max_tokens=4, loops=3, temperature=0.0, l_warmup_tokens=2, l_warmup_loops=1)),
    (list(b"zz"), dict(max_tokens=0)),
]


@pytest.fixture(scope="module")
def models(tiny_files) -> Iterator[dict[str, tinyloop.Model]]:
    with models_per_kv_mode(tiny_files["f32"], KV_MODES) as opened:
        yield opened


def _alone(model: tinyloop.Model, prompt: list[int], kw: dict) -> list[int]:
    return model.generate(prompt, **kw).tolist()


@pytest.mark.parametrize("mode", sorted(KV_MODES))
def test_requests_joining_at_different_steps_equal_each_alone(models, mode: str) -> None:
    m = models[mode]
    for together in (False, True):  # prompts prefilled one by one (the CPU's way) or batched (the GPU's)
        # 3 slots for 7 requests, prompts longer than a prefill chunk: rows join while others decode.
        s = tinyloop.Scheduler(m, max_batch=3, max_loops=4, prefill_chunk_tokens=8)
        s.prefill.together = together
        handles = []
        for i, (prompt, kw) in enumerate(REQUESTS):
            handles.append(s.submit(prompt, **kw))
            for _ in range(i % 3):
                s.step()
        s.stop(drain=True)
        for h, (prompt, kw) in zip(handles, REQUESTS, strict=True):
            assert h.result().tolist() == _alone(m, prompt, kw), (prompt, kw, together)
            assert h.finish_reason in ("stop", "length")
        assert handles[-1].result().size == 0 and handles[-1].finish_reason == "length"
        stats = s.stats()
        assert stats["running"] == stats["waiting"] == 0 and stats["finished"] == len(REQUESTS)
        assert stats["generated_tokens"] == sum(h.stats.generated_tokens for h in handles)
        assert (stats["prefill_rows"] > stats["prefill_steps"]) == together


@pytest.mark.parametrize("mode", ["16bit", "window", "none"])
def test_prompts_prefilled_together_equal_each_alone(models, mode: str) -> None:
    m = models[mode]
    prompts = [list(range(33, 33 + n)) for n in (9, 14, 3, 21, 6)]
    kws = [dict(max_tokens=4, loops=(2, 4, 3, 4, 1)[i], temperature=0.0) for i in range(len(prompts))]
    # Step 1: 9 + 11 of 14 tokens (cut, moves to staging row 0); step 2: its last 3, then 3 and 14 of 21.
    s = tinyloop.Scheduler(m, max_batch=5, max_loops=4, prefill_chunk_tokens=20, prefill_rows=3)
    s.prefill.together = True  # as on a GPU: one forward per round
    handles = [s.submit(p, **kw) for p, kw in zip(prompts, kws, strict=True)]
    s.stop(drain=True)
    for h, p, kw in zip(handles, prompts, kws, strict=True):
        assert h.result().tolist() == _alone(m, p, kw), (len(p), kw)
    stats = s.stats()
    assert stats["prefill_rows"] > stats["prefill_steps"] >= 3


def test_prompts_prefilled_together_stay_within_the_cache_when_padded(models) -> None:
    m = models["16bit"]
    prompts, kw = [list(range(40, 60)), list(range(50, 62))], dict(max_tokens=4, temperature=0.0)
    # Step 2 resumes the first prompt at position 16: the second's chunk is cut to 8 so that the rows,
    # padded to one width, still end inside the 24 positions.
    s = tinyloop.Scheduler(m, max_batch=2, max_seq_len=24, prefill_chunk_tokens=16, prefix_pool=False)
    s.prefill.together = True  # as on a GPU: one forward per round
    handles = [s.submit(p, **kw) for p in prompts]
    s.stop(drain=True)
    assert [h.result().tolist() for h in handles] == [_alone(m, p, kw) for p in prompts]
    assert s.stats()["prefill_steps"] == 3


def test_aborting_a_prompt_cut_by_the_budget_frees_its_slot_and_staging_row(models) -> None:
    m = models["16bit"]
    kw = dict(max_tokens=4, temperature=0.0)
    s = tinyloop.Scheduler(m, max_batch=2, prefill_chunk_tokens=8, prefill_rows=2, prefix_pool=False)
    cut = s.submit(list(range(40, 60)), **kw)
    s.step()  # 8 of its 20 tokens: it goes on next step
    s.abort(cut)
    after = [s.submit(p, **kw) for p in (list(range(60, 71)), list(b"abc"))]
    s.stop(drain=True)
    assert cut.finish_reason == "abort"
    assert [h.result().tolist() for h in after] == [_alone(m, list(range(60, 71)), kw), _alone(m, list(b"abc"), kw)]
    assert s.stats()["running"] == 0 and s.stats()["aborted"] == 1


def test_requests_from_a_thread_with_sleeps_stream_what_generate_gives(models) -> None:
    m = models["16bit"]
    want = [_alone(m, p, kw) for p, kw in REQUESTS]
    got: list[list[int]] = [[] for _ in REQUESTS]
    with tinyloop.Scheduler(m, max_batch=2, max_loops=4) as s:
        handles = []

        def submit_all() -> None:
            for prompt, kw in REQUESTS:
                handles.append(s.submit(prompt, **kw))
                time.sleep(0.01)

        t = threading.Thread(target=submit_all)
        t.start()
        t.join()
        for i, h in enumerate(handles):
            got[i] = list(h.tokens())  # streamed as they come
    assert got == want
    h = handles[0]
    assert h.stats.prompt_tokens == len(REQUESTS[0][0]) and h.stats.generated_tokens == 7
    assert h.stats.ttft_s is not None and 0 < h.stats.ttft_s <= h.stats.latency_s
    assert h.stats.loops_per_token == m.header.config.default_loops == 4
    assert handles[5].stats.loops_per_token == pytest.approx((3 + 1 + 1 + 3) / 4)


def test_eight_submitting_threads(models) -> None:
    m = models["int8"]
    prompts = [[(7 * i + j) % 200 + 30 for j in range(1 + i % 9)] for i in range(32)]
    want = {i: _alone(m, p, dict(max_tokens=3 + i % 4, temperature=0.0)) for i, p in enumerate(prompts)}
    got: dict[int, list[int]] = {}
    lock = threading.Lock()
    with tinyloop.Scheduler(m, max_batch=4) as s:

        def worker(k: int) -> None:
            for i in range(k, len(prompts), 8):
                out = s.submit(prompts[i], max_tokens=3 + i % 4, temperature=0.0).result(timeout=120).tolist()
                with lock:
                    got[i] = out

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == want


def test_abort_frees_the_slot_without_leaks_over_1000_requests(models) -> None:
    m = models["16bit"]
    pool = tinyloop.PrefixPool(max_bytes=200_000)
    s = tinyloop.Scheduler(m, max_batch=8, max_queue=64, prefill_chunk_tokens=64, prefix_pool=pool, max_loops=2)
    handles = []
    for i in range(1000):
        handles.append(s.submit([i % 250 + 1, (i * 7) % 250 + 1], max_tokens=3, loops=1 + i % 2, temperature=0))
        if i % 3 == 0:
            s.abort(handles[-1])  # aborted while waiting, or (below) while decoding
        if i % 8 == 7:
            s.step()
            s.abort(handles[-2])
            for _ in range(3):
                s.step()
    s.stop(drain=True)
    assert all(h.done for h in handles)
    assert {h.finish_reason for h in handles} <= {"abort", "length"}
    stats = s.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["finished"] + stats["aborted"] == 1000 and stats["aborted"] > 333
    assert s.slots is not None and int(s.slots.lengths.sum()) == 0
    s.slots.check_integrity()
    pool.check_integrity()
    assert pool.nbytes <= 200_000
    s.abort(handles[1])  # finished already: a no-op
    assert handles[1].finish_reason == "length"
    for h in handles:
        if h.finish_reason == "abort":
            assert list(h.tokens()) == h.result().tolist()


@pytest.mark.parametrize("mode", ["16bit", "int8", "hidden", "window"])
def test_prefix_pool_admission_equals_a_cold_prefill(models, mode: str) -> None:
    m = models[mode]
    base = list(b"You are a helpful assistant. ")
    prompts = [base + list(b"Hi"), base + list(b"Bye now"), base + list(b"Hi"), base[:20]]
    kw = dict(max_tokens=5, temperature=0.0)
    cold = tinyloop.Scheduler(m, max_batch=2, prefix_pool=False)
    warm = tinyloop.Scheduler(m, max_batch=2)
    outs = {}
    for name, s in (("cold", cold), ("warm", warm)):
        handles = []
        for p in prompts:
            handles.append(s.submit(p, **kw))
            for _ in range(8):  # finished (and offered to the pool) before the next one comes
                s.step()
        s.stop()
        outs[name] = [h.result().tolist() for h in handles]
    assert outs["warm"] == outs["cold"] == [_alone(m, p, kw) for p in prompts]
    hits = [h.stats.prefix_hit_tokens for h in handles]
    assert hits[0] == 0 and hits[2] == len(prompts[2])  # the same prompt again: an exact hit
    if mode != "window":  # a sliding window cannot truncate a longer entry
        assert hits[1] >= len(base) and hits[3] == 19
    assert warm.stats()["prefix_hit_requests"] == sum(h > 0 for h in hits)
    assert cold.stats()["prefix_hit_requests"] == 0


def test_submit_checks_arguments_like_generate(models) -> None:
    m = models["16bit"]
    s = tinyloop.Scheduler(m, max_batch=2, max_seq_len=32, max_loops=3)
    with pytest.raises(ValueError, match="temperature"):
        s.submit([1, 2], temperature=-1.0)
    with pytest.raises(TypeError, match="seed"):
        s.submit([1, 2], seed=True)
    with pytest.raises(ValueError, match="max_loops 3"):
        s.submit([1, 2], loops=4)
    with pytest.raises(ValueError, match="max_seq_len 32"):
        s.submit([1] * 30, max_tokens=3, loops=2)
    with pytest.raises(ValueError, match="prompt"):
        s.submit([], loops=2)
    with pytest.raises(ValueError, match="max_batch"):
        tinyloop.Scheduler(m, max_batch=0)
    with pytest.raises(TypeError, match="prefix_pool"):
        tinyloop.Scheduler(m, prefix_pool="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefill_rows"):
        tinyloop.Scheduler(m, prefill_rows=0)
    assert s.stats()["waiting"] == 0
    assert (s.limits.prefill_chunk_tokens, s.limits.prefill_rows) == (256, 2)  # the CPU's budget; rows <= slots


def test_a_full_queue_raises_queue_full_error(models) -> None:
    s = tinyloop.Scheduler(models["16bit"], max_batch=1, max_queue=2)
    s.submit([1], max_tokens=1)
    s.submit([2], max_tokens=1)
    with pytest.raises(tinyloop.QueueFullError, match="max_queue"):
        s.submit([3], max_tokens=1)
    assert issubclass(tinyloop.QueueFullError, RuntimeError)
    s.step()  # admits one: room for one more
    s.submit([3], max_tokens=1)
    s.stop()


def test_stop_aborts_or_drains_in_flight_requests(models) -> None:
    m = models["16bit"]
    s = tinyloop.Scheduler(m, max_batch=2)
    s.start()
    handles = [s.submit(list(b"abc"), max_tokens=40, temperature=0.0) for _ in range(5)]
    first = next(handles[0].tokens())  # running
    s.stop(drain=False, timeout=30)
    assert all(h.done for h in handles) and {h.finish_reason for h in handles} == {"abort"}
    assert list(handles[0].tokens())[0] == first
    with pytest.raises(RuntimeError, match="stopped"):
        s.submit([1], max_tokens=2)
    s2 = tinyloop.Scheduler(m, max_batch=2)
    s2.start()
    handles = [s2.submit(list(b"abc"), max_tokens=6, temperature=0.0) for _ in range(5)]
    s2.stop(drain=True, timeout=60)
    want = _alone(m, list(b"abc"), dict(max_tokens=6, temperature=0.0))
    assert [h.result().tolist() for h in handles] == [want] * 5
    with pytest.raises(TimeoutError):
        tinyloop.Scheduler(m).submit([1], max_tokens=2).result(timeout=0.01)  # never started


def test_a_failing_request_ends_alone(models, monkeypatch) -> None:
    m = models["16bit"]
    s = tinyloop.Scheduler(m, max_batch=2)
    good = s.submit(list(b"abc"), max_tokens=4, temperature=0.0)
    bad = s.submit(list(b"xyz"), max_tokens=4, temperature=0.0)
    s.step()
    req = next(r for r in s._rows if r is not None and r.handle is bad)

    def fail(logits: torch.Tensor, prepared: object = None) -> int:
        raise NonFiniteLogitsError()

    monkeypatch.setattr(req.row.picker, "pick", fail)
    s.stop(drain=True)
    assert good.result().tolist() == _alone(m, list(b"abc"), dict(max_tokens=4, temperature=0.0))
    assert bad.finish_reason == "error" and isinstance(bad.error, NonFiniteLogitsError)
    with pytest.raises(NonFiniteLogitsError):
        bad.result()
    with pytest.raises(NonFiniteLogitsError):
        list(bad.tokens())
    assert s.stats()["failed"] == 1
    assert isinstance(good.result(), np.ndarray) and good.result().dtype == np.int32


def test_batched_decode_steps_take_the_cpu_fast_path(models, monkeypatch) -> None:
    m = models["16bit"]
    decoder = m._engine.decoder
    assert decoder is not None  # float32 on the CPU: the CPU decode path
    handled: list[int] = []
    decode = decoder.decode

    def counting(step, cache):  # type: ignore[no-untyped-def]
        out = decode(step, cache)
        if step.tokens.shape[1] == 1:  # a decode step (prefills have the prompt's length)
            handled.append(step.tokens.shape[0] if out is not None else -1)
        return out

    monkeypatch.setattr(decoder, "decode", counting)
    s = tinyloop.Scheduler(m, max_batch=4)
    handles = [s.submit(list(b"abc"[: i + 2]), max_tokens=4 + i, temperature=0.0) for i in range(3)]
    s.stop(drain=True)
    assert [h.result().tolist() for h in handles] == [
        _alone(m, list(b"abc"[: i + 2]), dict(max_tokens=4 + i, temperature=0.0)) for i in range(3)
    ]
    # Every decode step went through it (none declined: -1), over the leading slots in use (a power of two).
    assert handled and set(handled) <= {1, 2, 4} and 4 in handled


EXIT_ROWS = [
    (list(b"Hello there"), dict(exit_criterion="argmax", exit_tol=1)),
    (list(b"abc"), dict(exit_criterion="latent", exit_tol=0.5, min_loops=2)),
    (list(b"The value of x is"), dict()),
    (list(b"q"), dict(exit_criterion="kl", exit_tol=0.05)),
    (list(b"zz top"), dict(exit_criterion="entropy", exit_tol=0.05, temperature=0.9, seed=4)),
]


def test_per_row_exit_in_a_batch_equals_each_row_alone(models) -> None:
    m = models["16bit"]
    s = tinyloop.Scheduler(m, max_batch=4, max_loops=6)
    handles = []
    for i, (prompt, kw) in enumerate(EXIT_ROWS):
        handles.append(s.submit(prompt, max_tokens=8, loops=6, **{"temperature": 0.0, **kw}))
        if i % 2:
            s.step()  # the next rows join a running batch
    s.stop()
    depths = []
    for h, (prompt, kw) in zip(handles, EXIT_ROWS, strict=True):
        alone = m.generate_tokens(prompt, 8, 6, stop=False, **{"temperature": 0.0, **kw}).tolist()
        assert h.result().tolist() == alone
        assert h.stats.token_loops == m.last_family_stats.exit_depths
        depths += h.stats.token_loops[1:]
    assert min(depths) < 6 and max(depths) == 6  # rows did exit early, at different depths
    assert handles[2].stats.loops_per_token == 6


@pytest.mark.parametrize("mode", ["int8", "hidden", "window"])
def test_per_row_exit_batched_equals_alone_in_other_kv_modes(models, mode: str) -> None:
    m = models[mode]
    outs = {}
    for batch in (1, 4):
        s = tinyloop.Scheduler(m, max_batch=batch, max_loops=6)
        handles = [s.submit(p, max_tokens=6, loops=6, **{"temperature": 0.0, **kw}) for p, kw in EXIT_ROWS]
        s.stop()
        outs[batch] = [(h.result().tolist(), h.stats.token_loops) for h in handles]
    assert outs[1] == outs[4]
    assert min(d for _, loops in outs[4] for d in loops) < 6


def test_an_unexpected_step_error_fails_the_requests_and_the_loop_goes_on(models, monkeypatch) -> None:
    m = models["16bit"]
    s = tinyloop.Scheduler(m, max_batch=2)
    broken = RuntimeError("a bug in a step")

    def fail_once() -> None:
        monkeypatch.undo()
        raise broken

    monkeypatch.setattr(s, "_free_finished", fail_once)
    lost = [s.submit(list(b"abc"), max_tokens=3, temperature=0.0) for _ in range(3)]  # two running, one waiting
    with s:
        for h in lost:
            with pytest.raises(RuntimeError, match="a bug in a step"):
                h.result(timeout=60)
        assert {h.finish_reason for h in lost} == {"error"}
        after = s.submit(list(b"abc"), max_tokens=3, temperature=0.0).result(timeout=60)
    assert after.tolist() == _alone(m, list(b"abc"), dict(max_tokens=3, temperature=0.0))
    assert s.stats()["failed"] == 3 and s.stats()["running"] == 0
