"""The runtime switch: routing, reproducibility per seed, zero change when off, cache consistency."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tinyloop import Model
from tinyloop.kernels.dispatch import weight_kind
from tinyloop.model.cross_iter import at_iteration, has_cross_iter
from tinyloop.stochastic.weight import StochasticInt4Weight

TOKENS = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38], dtype=np.int32)


def score(path: Path, **kw: object) -> np.ndarray:
    with Model(path, device="cpu", **kw) as m:  # type: ignore[arg-type]
        return m.score(TOKENS, loops=6)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TINYLOOP_CROSS_ITER_ROUND", raising=False)


@pytest.mark.parametrize("kind", ["sign", "frac4"])
def test_off_is_plain_int4_and_on_is_reproducible(files: dict[str, Path], kind: str) -> None:
    plain = score(files["int4"])
    assert np.array_equal(score(files[kind]), plain)
    assert np.array_equal(score(files[kind], cross_iter_round=False), plain)
    a = score(files[kind], cross_iter_round=True, cross_iter_seed=1)
    assert not np.array_equal(a, plain)
    assert np.array_equal(a, score(files[kind], cross_iter_round=True, cross_iter_seed=1))
    assert not np.array_equal(a, score(files[kind], cross_iter_round=True, cross_iter_seed=2))


def test_env_switch(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYLOOP_CROSS_ITER_ROUND", "1")
    assert np.array_equal(score(files["frac4"]), score(files["frac4"], cross_iter_round=True, cross_iter_seed=0))
    # A file without channels runs unchanged under the environment switch ...
    monkeypatch.delenv("TINYLOOP_CROSS_ITER_ROUND")
    plain = score(files["int4"])
    monkeypatch.setenv("TINYLOOP_CROSS_ITER_ROUND", "1")
    assert np.array_equal(score(files["int4"]), plain)


def test_explicit_request_needs_channels(files: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="tinyloop-add-sign-bit"):
        Model(files["int4"], device="cpu", cross_iter_round=True)
    with pytest.raises(ValueError, match="cross_iter_seed"):
        Model(files["sign"], device="cpu", cross_iter_round=True, cross_iter_seed=-1)


def test_looped_matrices_stay_quantized_and_bind_per_iteration(files: dict[str, Path]) -> None:
    with Model(files["sign"], device="cpu", cross_iter_round=True, cross_iter_seed=4) as m:
        w = m._engine.weights
        assert has_cross_iter(w) and isinstance(w.adapter, StochasticInt4Weight)
        assert isinstance(w.body[0].qkv, StochasticInt4Weight) and w.body[0].qkv.iteration is None
        assert isinstance(w.prelude[0].qkv, torch.Tensor)  # outside the loop: dequantized once, as always
        bound = at_iteration(w, 5)
        qkv = bound.body[0].qkv
        assert isinstance(qkv, StochasticInt4Weight) and qkv.iteration == 5 and weight_kind(qkv) == "int4_stoch"
        assert at_iteration(bound, 6).body[1].down.iteration == 6  # type: ignore[union-attr]
    with Model(files["sign"], device="cpu") as m:
        assert not has_cross_iter(m._engine.weights)
        assert at_iteration(m._engine.weights, 3) is m._engine.weights


def test_cached_generation_matches_uncached(files: dict[str, Path]) -> None:
    """The draw depends on (seed, iteration, matrix) only, never on how the sequence is split into steps."""
    outs = []
    for kv_mode in ("16bit", "none"):
        with Model(files["frac4"], device="cpu", kv_mode=kv_mode, cross_iter_round=True, cross_iter_seed=3) as m:
            outs.append(m.generate(TOKENS[:4], max_tokens=8, loops=4, temperature=0.0))
    assert np.array_equal(outs[0], outs[1])


def test_cpu_cache_gives_the_same_logits_and_fills_up_to_its_budget(files: dict[str, Path]) -> None:
    from tinyloop.runtime.loader import load_engine
    from tinyloop.stochastic.weight import CrossIterRound
    from tinyloop.train.evaluate import sweep_logits

    tokens = torch.from_numpy(TOKENS.astype(np.int64))[None, :]
    logits = []
    for mib in (0, 512):
        _, eng = load_engine(files["sign"], torch.device("cpu"), torch.float32, CrossIterRound(7, cpu_cache_mib=mib))
        for _ in range(2):  # the second pass reads the cache
            logits.append(dict(sweep_logits(eng, tokens, [5]))[5])
        qkv = eng.weights.body[0].qkv
        assert isinstance(qkv, StochasticInt4Weight)
        assert (qkv.cache is None) == (mib == 0)
        if qkv.cache is not None:
            assert len(qkv.cache) == 5 * 9  # 5 iterations x 9 looped matrices
    assert all(torch.equal(x, logits[0]) for x in logits[1:])
