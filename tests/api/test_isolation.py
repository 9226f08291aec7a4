"""Requests on one Model are isolated: threads, interleaved streams, close(), non-finite logits, memory."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import tinyloop
from tinyloop.api.base import IDLE_CACHES
from tinyloop.errors import NonFiniteLogitsError

PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3], [200, 17, 99, 4, 5, 6, 7, 8], [65]]


@pytest.fixture(scope="module")
def model(tiny_files):
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as m:
        yield m


def _alone(model, prompt, **kw) -> list[int]:
    return model.generate(prompt, 12, loops=3, **kw).tolist()


def test_four_threads_give_what_each_gives_alone(model) -> None:
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.9, "seed": 5},
        {"temperature": 0.0},
        {"temperature": 1.2, "seed": 1},
    ]
    want = [_alone(model, p, **kw) for p, kw in zip(PROMPTS, kinds, strict=True)]
    got: list[list[list[int]]] = [[] for _ in PROMPTS]

    def work(i: int) -> None:
        for _ in range(5):
            got[i].append(_alone(model, PROMPTS[i], **kinds[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [[w] * 5 for w in want]


def test_interleaved_streams_give_what_each_gives_alone(model) -> None:
    want_a = _alone(model, PROMPTS[0], temperature=0.0)
    want_b = _alone(model, PROMPTS[2], temperature=0.8, seed=3)
    a = model.generate_stream(PROMPTS[0], 12, loops=3, temperature=0.0)
    b = model.generate_stream(PROMPTS[2], 12, loops=3, temperature=0.8, seed=3)
    got_a, got_b = [], []
    for x, y in zip(a, b, strict=True):
        got_a.append(x)
        got_b.append(y)
        # a whole generate() between two steps of the streams changes neither
        model.generate(PROMPTS[1], 3, loops=2, temperature=0.0)
    assert (got_a, got_b) == (want_a, want_b)


def test_a_stream_after_close_raises(tiny_files) -> None:
    m = tinyloop.Model(tiny_files["f32"], max_seq_len=64)
    stream = m.generate_stream(PROMPTS[0], 10, loops=2, temperature=0.0)
    next(stream)
    m.close()
    with pytest.raises(RuntimeError, match="^model was closed$"):
        next(stream)
    with pytest.raises(RuntimeError, match="^model was closed$"):
        m.generate(PROMPTS[0], 2)


def test_non_finite_logits_stop_that_request_only(tiny_files) -> None:
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as m:
        clean = [_alone(m, p, temperature=0.0) for p in PROMPTS[:2]]
        pc = m.build_prefix_cache(PROMPTS[1], loops=3)
        embed = m._engine.weights.embed
        assert isinstance(embed, torch.Tensor)
        poison = 250
        saved = embed[poison].clone()
        embed[poison] = float("nan")  # any request that reads token 250 overflows
        try:
            for call in (
                lambda: m.generate([5, poison, 6], 4, loops=3, temperature=0.0),
                lambda: m.generate([5, poison, 6], 4, loops=3, temperature=0.7, seed=1),
                lambda: list(m.generate_stream([poison], 4, loops=3, temperature=0.0)),
                lambda: m.generate_from_prefix_cache(pc, [poison], 4, temperature=0.0),
            ):
                with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
                    call()
        finally:
            embed[poison] = saved
        assert [_alone(m, p, temperature=0.0) for p in PROMPTS[:2]] == clean
        assert (
            m.generate_from_prefix_cache(pc, [7], 3, temperature=0.0).tolist()
            == m.generate([*PROMPTS[1], 7], 3, loops=3, temperature=0.0).tolist()
        )


def test_no_cache_or_memory_growth_over_a_thousand_mixed_requests(model) -> None:
    model.generate(PROMPTS[0], 2, loops=3)
    before = model._cache_bytes()
    rng = np.random.default_rng(0)
    for i in range(1000):
        prompt = PROMPTS[i % len(PROMPTS)]
        kind = i % 4
        if kind == 0:
            model.generate(prompt, 2, loops=int(rng.integers(1, 4)), temperature=0.0)
        elif kind == 1:
            stream = model.generate_stream(prompt, 5, loops=2, seed=i)
            next(stream)
            stream.close()
        elif kind == 2:
            next(model.generate_stream(prompt, 5, loops=2))  # dropped without close()
        else:
            model.generate(prompt, 1, loops=3, stop_tokens=[1, 2, 3], temperature=0.5, seed=i)
    assert len(model._idle_caches) <= IDLE_CACHES and len(model._busy_caches) == 0
    assert model._cache_bytes() <= before
