"""generate_batch: each row equals the same request run alone (greedy and seeded sampling, on the CPU),
for mixed prompt lengths, max_tokens, loops, sampling parameters, stops, grammars and KV modes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop
from helpers import models_per_kv_mode, random_flat_weights
from naive_reference import naive_forward
from tinyloop.presets import preset

KV_MODES = {"16bit": 0, "int8": 0, "hidden": 0, "window": 6, "none": 0}


@pytest.fixture(scope="module")
def models(tiny_files) -> Iterator[dict[str, tinyloop.Model]]:
    with models_per_kv_mode(tiny_files["f32"], KV_MODES) as opened:
        yield opened


def _alone(model: tinyloop.Model, prompt: list[int], **kw) -> list[int]:
    return model.generate(prompt, **kw).tolist()


row_strategy = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(32, 126), min_size=1, max_size=9),
        "max_tokens": st.integers(0, 7),
        "loops": st.integers(1, 4),
        "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.3]),
        "top_k": st.sampled_from([0, 5, 50]),
        "top_p": st.sampled_from([1.0, 0.8]),
        "seed": st.integers(0, 2**32),
        "stop_tokens": st.sampled_from([None, [101], [32, 97]]),
        "stop": st.sampled_from([None, ["e "], ["a", "zz"]]),
    }
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(row_strategy, min_size=1, max_size=4), mode=st.sampled_from(sorted(KV_MODES)))
def test_batched_rows_equal_each_request_alone(models, rows, mode: str) -> None:
    m = models[mode]
    names = ("max_tokens", "loops", "temperature", "top_k", "top_p", "seed", "stop_tokens", "stop")
    kwargs = {name: [r[name] for r in rows] for name in names}
    kwargs["stop_tokens"] = [r["stop_tokens"] or [] for r in rows]  # per-row lists
    kwargs["stop"] = [r["stop"] or [] for r in rows]
    got = m.generate_batch([r["prompt"] for r in rows], **kwargs)
    want = [_alone(m, r["prompt"], **{name: r[name] for name in names}) for r in rows]
    assert [g.tolist() for g in got] == want
    assert all(g.dtype == np.int32 for g in got)


@pytest.mark.parametrize("mode", sorted(KV_MODES))
def test_grammars_and_depth_schedules_batched(models, mode: str) -> None:
    m = models[mode]
    prompts = [list(b"n="), list(b"The value is "), list(b"x")]
    grammars = [r"[0-9]{1,4}", None, r"(ab|cd)+;"]
    got = m.generate_batch(prompts, max_tokens=[6, 5, 7], loops=[3, 2, 4], temperature=[0.0, 0.9, 0.0],
                           seed=[None, 11, None], grammar=grammars)  # fmt: skip
    want = [
        _alone(m, p, max_tokens=n, loops=lo, temperature=t, seed=s, grammar=g)
        for p, n, lo, t, s, g in zip(
            prompts, [6, 5, 7], [3, 2, 4], [0.0, 0.9, 0.0], [None, 11, None], grammars, strict=True
        )
    ]
    assert [g.tolist() for g in got] == want


@pytest.mark.parametrize("mode", ["16bit", "int8", "window", "hidden"])
def test_depth_schedule_rows_equal_alone(models, mode: str) -> None:
    m = models[mode]
    prompts = [list(b"abc"), list(b"hello there")]
    got = m.generate_batch_stream(prompts, max_tokens=6, loops=[4, 3], temperature=0.0)
    tokens: list[list[int]] = [[], []]
    for row, token in got:
        tokens[row].append(token)
    assert tokens == [
        _alone(m, p, max_tokens=6, loops=lo, temperature=0.0) for p, lo in zip(prompts, [4, 3], strict=True)
    ]


def test_one_batched_greedy_case_follows_the_naive_reference(models) -> None:
    cfg = preset("test-tiny")
    flat = random_flat_weights(cfg, seed=7)
    prompts = [[72, 101, 108], [1, 2, 3, 4, 5, 6, 7], [200]]
    loops = [2, 3, 1]
    got = models["16bit"].generate_batch(prompts, max_tokens=4, loops=loops, temperature=0.0)
    for prompt, n_loops, out in zip(prompts, loops, got, strict=True):
        seq = list(prompt)
        for token in out:
            ref, _, _ = naive_forward(cfg, flat, seq, n_loops)
            assert int(token) == int(ref[-1].argmax())
            seq.append(int(token))


def test_arguments_per_row_or_shared(models) -> None:
    m = models["16bit"]
    with pytest.raises(ValueError, match="max_tokens has 3 values for 2 prompts"):
        m.generate_batch([[1], [2]], max_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="seed"):
        m.generate_batch([[1], [2]], seed=[1, -1])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        m.generate_batch([[1], []])
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_seq_len"):
        m.generate_batch([[1] * 60], max_tokens=10)
    shared = m.generate_batch([[5, 6], [7]], max_tokens=3, stop_tokens=[256 - 1], temperature=0)
    assert [s.tolist() for s in shared] == [_alone(m, p, max_tokens=3, stop_tokens=[255], temperature=0)
                                            for p in ([5, 6], [7])]  # fmt: skip
    # a row that may produce nothing beside one that does (its prompt is the longest)
    mixed = m.generate_batch([[32], [7, 8, 9]], max_tokens=[2, 0], temperature=0)
    assert [x.tolist() for x in mixed] == [_alone(m, [32], max_tokens=2, temperature=0), []]
    arr = m.generate_batch(np.array([[5, 6], [7, 8]], dtype=np.int32), max_tokens=2, temperature=0)
    assert [a.tolist() for a in arr] == [_alone(m, p, max_tokens=2, temperature=0) for p in ([5, 6], [7, 8])]


def test_bfloat16_matmul_rows_equal_each_request_alone() -> None:
    """The built-in model with bfloat16 matmuls (torch's CPU INT4 kernel up to 8 rows, a dense bfloat16 GEMM
    beyond, which round differently): prompts of different lengths batched give what each gives alone. A
    prompt prefilled alone by the CPU decode path once parted from the batch's generic prefill at token 0."""
    from tinyloop.kernels import cpu_int4
    from tinyloop.runtime.benchmark import matmul_dtype

    model = tinyloop.Model("tiny", max_seq_len=256, dtype=torch.bfloat16)
    try:
        assert matmul_dtype(model._engine) == ("bfloat16" if cpu_int4.available() else "float32")
        rng = np.random.default_rng(1)
        prompts = [rng.integers(1, 256, n).astype(np.int32) for n in (20, 57, 90)]
        alone = [model.generate(p, 6, loops=2, temperature=0.0).tolist() for p in prompts]
        batch = model.generate_batch(prompts, max_tokens=6, loops=2, temperature=0.0)
        assert [row.tolist() for row in batch] == alone
    finally:
        model.close()
