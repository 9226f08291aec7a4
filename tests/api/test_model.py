"""The Python API: results against the naive reference, argument errors, lifecycle, sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyloop
import tinyloop_py
from helpers import max_rel_error, random_flat_weights
from naive_reference import naive_forward
from tinyloop.presets import preset

PROMPT = np.array([72, 101, 108, 108, 111, 32, 119], dtype=np.int32)


@pytest.fixture(scope="module")
def model(tiny_files):
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as m:
        yield m


def test_both_import_names_expose_the_same_model_class() -> None:
    assert tinyloop_py.Model is tinyloop.Model
    assert tinyloop_py.load is tinyloop.load


@pytest.mark.parametrize("loops", [1, 3])
def test_score_matches_naive_reference(model, loops: int) -> None:
    cfg = preset("test-tiny")
    ref, _, _ = naive_forward(cfg, random_flat_weights(cfg, seed=7), PROMPT.tolist(), loops)
    got = model.score(PROMPT, loops=loops)
    assert got.dtype == np.float32 and got.shape == (len(PROMPT), 256)
    assert max_rel_error(torch.from_numpy(got), ref) <= 1e-5
    last = model.score_last(PROMPT, loops=loops)
    assert last.shape == (256,)
    assert max_rel_error(torch.from_numpy(last), ref[-1]) <= 1e-5


def test_greedy_generation_follows_the_reference_argmax(model) -> None:
    cfg = preset("test-tiny")
    flat = random_flat_weights(cfg, seed=7)
    out = model.generate(PROMPT, max_tokens=6, loops=2, temperature=0.0)
    assert out.dtype == np.int32 and out.shape == (6,)
    seq = PROMPT.tolist()
    for token in out:
        ref, _, _ = naive_forward(cfg, flat, seq, 2)
        assert int(token) == int(ref[-1].argmax())
        seq.append(int(token))


def test_cached_and_uncached_generation_agree(tiny_files, monkeypatch) -> None:
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as cached:
        a = cached.generate(PROMPT, max_tokens=12, loops=3, temperature=0.0)
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as uncached:
        b = uncached.generate(PROMPT, max_tokens=12, loops=3, temperature=0.0)
    assert a.tolist() == b.tolist()


def test_seeded_sampling_repeats_and_seeds_differ(model) -> None:
    a = model.generate(PROMPT, max_tokens=20, loops=2, temperature=1.0, top_k=0, seed=5)
    b = model.generate(PROMPT, max_tokens=20, loops=2, temperature=1.0, top_k=0, seed=5)
    c = model.generate(PROMPT, max_tokens=20, loops=2, temperature=1.0, top_k=0, seed=6)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()


def test_top_k_one_is_greedy(model) -> None:
    greedy = model.generate(PROMPT, max_tokens=8, loops=2, temperature=0.0)
    top1 = model.generate(PROMPT, max_tokens=8, loops=2, temperature=1.5, top_k=1, seed=1)
    assert greedy.tolist() == top1.tolist()


def test_token_inputs_lists_and_lossless_conversions(model) -> None:
    ref = model.score_last(PROMPT, loops=1)
    assert np.array_equal(model.score_last(PROMPT.tolist(), loops=1), ref)
    assert np.array_equal(model.score_last(PROMPT.astype(np.int64), loops=1), ref)
    assert np.array_equal(model.score_last(PROMPT.astype(np.float64), loops=1), ref)
    with pytest.raises(ValueError, match="without loss"):
        model.score_last(PROMPT + 0.5, loops=1)
    with pytest.raises(ValueError, match="1-D"):
        model.score_last(PROMPT[None], loops=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.score_last([1, 256], loops=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.score_last([-1, 2], loops=1)
    with pytest.raises(ValueError, match="empty"):
        model.score_last([], loops=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(loops=0), "loops"),
        (dict(loops=-2), "loops"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=60), "max_seq_len"),
    ],
)
def test_generate_argument_errors(model, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        model.generate(PROMPT, **kwargs)


def test_closed_model_raises(tiny_files) -> None:
    m = tinyloop.load(tiny_files["int8"], max_seq_len=32)
    m.close()
    m.close()  # idempotent
    for call in (lambda: m.score(PROMPT), lambda: m.generate(PROMPT, 2), lambda: m.config, m.vram_usage_mb):
        with pytest.raises(RuntimeError, match="^model was closed$"):
            call()


def test_config_and_memory_report(tiny_files) -> None:
    with tinyloop.Model(tiny_files["int4"], max_seq_len=32) as m:
        cfg = m.config
        assert cfg["d_model"] == 64 and cfg["bits"] == 4 and cfg["max_seq_len"] == 32
        before = m.vram_usage_mb()
        m.generate(PROMPT, 4, loops=4, temperature=0.0)
        after = m.vram_usage_mb()
        kv = 2 * preset("test-tiny").n_cache_slots(4) * 32 * preset("test-tiny").kv_dim * 4 / 2**20
        assert after - before == pytest.approx(kv, rel=1e-6)


def test_out_of_memory_is_a_runtime_error_starting_with_out_of_memory(tiny_files, monkeypatch) -> None:
    import tinyloop.cache.memory as memory

    # Room for the 512 positions' tables (~100 kB), not for the KV cache (~1.3 MB).
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 200_000)
    with tinyloop.Model(tiny_files["f16"], max_seq_len=512) as m:
        with pytest.raises(RuntimeError, match="^out of memory"):
            m.generate(PROMPT, 4)


@pytest.mark.parametrize("kind, bound", [("f16", 5e-3), ("int8", 5e-2), ("int4", 0.7)])
def test_quantized_files_stay_close_to_float(tiny_files, kind: str, bound: float) -> None:
    with tinyloop.Model(tiny_files["f32"]) as ref_model, tinyloop.Model(tiny_files[kind]) as q_model:
        ref = ref_model.score(PROMPT, loops=4)
        got = q_model.score(PROMPT, loops=4)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert 0 < err <= bound


def test_unknown_builtin_name_lists_the_builtins() -> None:
    with pytest.raises(ValueError, match="built-in models"):
        tinyloop.Model("no-such-model-name")
