"""Per-token log-probabilities (SamplingParams.logprobs): the model's own distribution at each generated token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyloop


@pytest.fixture(scope="module")
def tiny() -> tinyloop.Model:
    return tinyloop.Model("tiny")


def test_logprobs_are_the_models_log_softmax_at_each_token(tiny: tinyloop.Model) -> None:
    prompt = np.frombuffer(b"The loop ", dtype=np.uint8).astype(np.int32)
    plain = tiny.generate(prompt, 6, temperature=0)
    out = tiny.generate(prompt, 6, temperature=0, logprobs=3)
    np.testing.assert_array_equal(out, plain)  # recording changes nothing
    records = tiny.last_stats.logprobs
    assert [r.token for r in records] == out.tolist()
    logits = tiny.score(np.concatenate([prompt, out]))  # next-token logits at every position
    for i, rec in enumerate(records):
        logp = torch.log_softmax(torch.tensor(logits[len(prompt) - 1 + i], dtype=torch.float64), -1)
        assert rec.logprob == pytest.approx(float(logp[rec.token]), abs=1e-4)
        top = torch.topk(logp, 3)
        assert [t for t, _ in rec.top] == top.indices.tolist()
        assert rec.top[0][0] == rec.token  # greedy picks the most likely token
        assert [v for _, v in rec.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_sampled_tokens_get_their_own_logprob_and_none_records_nothing(tiny: tinyloop.Model) -> None:
    prompt = np.frombuffer(b"abc", dtype=np.uint8).astype(np.int32)
    out = tiny.generate(prompt, 5, temperature=1.0, seed=3, logprobs=0)
    assert [r.token for r in tiny.last_stats.logprobs] == out.tolist()
    assert all(r.top == () and r.logprob <= 0.0 for r in tiny.last_stats.logprobs)
    tiny.generate(prompt, 5, temperature=1.0, seed=3)
    assert tiny.last_stats.logprobs == []


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True])
def test_logprobs_out_of_range_is_refused(tiny: tinyloop.Model, bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match="logprobs"):
        tiny.generate([1, 2], 2, logprobs=bad)


def test_scheduled_requests_record_the_same_logprobs_as_alone(tiny: tinyloop.Model) -> None:
    prompts = [np.frombuffer(p, dtype=np.uint8).astype(np.int32) for p in (b"One", b"Two loops")]
    with tinyloop.Scheduler(tiny, max_batch=2, max_seq_len=64) as scheduler:
        handles = [scheduler.submit(p, 5, temperature=0, logprobs=2) for p in prompts]
        outs = [h.result(60) for h in handles]
    for prompt, out, handle in zip(prompts, outs, handles, strict=True):
        alone = tiny.generate(prompt, 5, temperature=0, logprobs=2)
        np.testing.assert_array_equal(out, alone)
        got = handle.stats.logprobs
        assert [r.token for r in got] == alone.tolist()
        for mine, ref in zip(got, tiny.last_stats.logprobs, strict=True):
            assert mine.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert [t for t, _ in mine.top] == [t for t, _ in ref.top]
