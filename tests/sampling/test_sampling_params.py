"""SamplingParams: the one validator every generation entry point uses."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.grammar import Grammar
from tinyloop.sampling import SamplingParams

BAD = [
    ("max_tokens", -1),
    ("max_tokens", True),
    ("max_tokens", 2.0),
    ("loops", 0),
    ("loops", np.bool_(True)),
    ("temperature", True),
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", 1e-310),
    ("temperature", "hot"),
    ("top_k", -1),
    ("top_k", False),
    ("top_k", 3.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", True),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", True),
    ("seed", 1.5),
    ("stop", 5),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop_tokens", 5.5),
    ("stop_tokens", [1, True]),
    ("stop_tokens", [-2]),
    ("stop_tokens", "ab"),
    ("grammar", 7),
    ("l_warmup_tokens", -1),
    ("l_warmup_loops", 0),
    ("exit_threshold", 1.5),
    ("exit_threshold", True),
    ("exit_at_step", -1),
    ("weighted_exit", 1),
    ("exit_tol", 0.1),  # without exit_criterion
    ("min_loops", 0),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_every_bad_value_is_refused_naming_the_parameter(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_a_bad_exit_criterion_is_refused() -> None:
    with pytest.raises(ValueError, match="exit_criterion"):
        SamplingParams(exit_criterion="nope")


def test_numpy_scalars_are_accepted_and_normalised() -> None:
    p = SamplingParams(
        max_tokens=np.int64(5), loops=np.int32(3), temperature=np.float32(0.5), top_k=np.int16(4),
        top_p=np.float64(0.9), seed=np.uint64(2**64 - 1), stop_tokens=np.int32(7), l_warmup_tokens=np.int8(1),
    )  # fmt: skip
    assert (p.max_tokens, p.loops, p.top_k, p.seed) == (5, 3, 4, 2**64 - 1)
    assert type(p.max_tokens) is int and type(p.temperature) is float and p.temperature == 0.5
    assert p.stop_tokens == frozenset({7})
    assert SamplingParams(stop_tokens=np.array([1, 2])).stop_tokens == frozenset({1, 2})


def test_normal_forms() -> None:
    p = SamplingParams(stop="ab", grammar="[0-9]+", temperature=0)
    assert p.stop == (b"ab",) and isinstance(p.grammar, Grammar) and p.greedy
    assert SamplingParams(stop=[b"x", "y"]).stop == (b"x", b"y")
    with pytest.raises(ValueError, match="l_warmup_loops"):
        SamplingParams(loops=2, l_warmup_tokens=1, l_warmup_loops=3)
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]


def test_the_public_methods_use_the_same_validator(tiny_files) -> None:
    with tinyloop.Model(tiny_files["f32"], max_seq_len=32) as m:
        for call in (m.generate, m.generate_stream, m.generate_tokens):
            with pytest.raises(ValueError, match="temperature"):
                call([1, 2], 2, temperature=True)
            with pytest.raises(ValueError, match="seed"):
                call([1, 2], 2, seed=-3)
        with pytest.raises(ValueError, match="temperature"):
            m.generate_speculative([1, 2], 2, temperature=1e-310)
        with pytest.raises(ValueError, match="stop_tokens"):
            m.generate([1, 2], 2, stop_tokens=[256])
        pc = m.build_prefix_cache([1, 2, 3], loops=2)
        with pytest.raises(ValueError, match="top_p"):
            m.generate_from_prefix_cache(pc, [4], 2, top_p=2.0)
        got = m.generate([1, 2], 3, loops=2, temperature=np.float32(0.7), seed=np.int64(3))
        assert got.tolist() == m.generate([1, 2], 3, loops=2, temperature=0.7, seed=3).tolist()
