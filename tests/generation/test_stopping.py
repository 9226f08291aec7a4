"""Streaming, stop tokens, stop strings across token boundaries, and early close."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from tinyloop.api.model import Model
from tinyloop.grammar.vocab import TokenVocab
from tinyloop.runtime.stop_strings import StopStringFilter, StreamPiece


@pytest.fixture(scope="module")
def model(tiny_files):
    with Model(tiny_files["f32"], max_seq_len=256) as m:
        yield m


def _sample(model: Model, **kw) -> np.ndarray:
    return model.generate(list(b"Hi there"), 60, 4, temperature=1.0, top_k=0, seed=11, **kw)


def test_stop_tokens_end_generation_and_are_not_returned(model) -> None:
    full = _sample(model)
    stop = int(full[10])
    cut = _sample(model, stop_tokens=[stop])
    first = int(np.flatnonzero(full == stop)[0])
    np.testing.assert_array_equal(cut, full[:first])
    assert model.last_stats.stop_reason == "stop_token"


def test_stop_strings_across_tokens_are_not_emitted(model) -> None:
    full = _sample(model)
    text = bytes(full.tolist())
    stop = text[20:23]  # three tokens of a byte vocabulary
    cut = _sample(model, stop=[stop])
    assert bytes(cut.tolist()) == text[: text.find(stop)]
    assert model.last_stats.stop_reason == "stop_string"
    pieces = list(model.generate_stream(list(b"Hi there"), 60, 4, 1.0, 0, 1.0, 11, stop=[stop], text=True))
    assert all(isinstance(p, StreamPiece) for p in pieces)
    assert [p.token for p in pieces] == cut.tolist()
    assert "".join(p.text for p in pieces) == text[: text.find(stop)].decode("utf-8", "replace")


def test_stop_filter_with_multi_byte_tokens() -> None:
    vocab = TokenVocab.from_pieces([b"ab", b"cd", b"e", b"xab", b"c", b"z"])
    flt = StopStringFilter(vocab, [b"bcd"])
    out = []
    for tok in [5, 3, 1, 2]:  # "z" "xab" "cd" "e": the stop "bcd" starts inside "xab"
        out += flt.feed(tok)
        if flt.matched:
            break
    assert out == [(5, b"z"), (3, b"xa")] and flt.matched
    flt = StopStringFilter(vocab, [b"abz"])
    assert flt.feed(0) == [] and flt.feed(4) == [(0, b"ab"), (4, b"c")] and not flt.matched


def test_closing_the_stream_stops_and_releases(model) -> None:
    full = _sample(model)
    stream = model.generate_stream(list(b"Hi there"), 60, 4, 1.0, 0, 1.0, 11)
    got = [next(stream) for _ in range(5)]
    ref = weakref.ref(stream)
    stream.close()
    assert model.last_stats.stop_reason == "closed" and model.last_stats.generated_tokens == 5
    del stream
    gc.collect()
    assert ref() is None
    np.testing.assert_array_equal(got, full[:5])
    for i, _tok in enumerate(model.generate_stream(list(b"Hi there"), 60, 4, 1.0, 0, 1.0, 11)):
        if i == 3:
            break
    np.testing.assert_array_equal(_sample(model), full)  # the model is reusable afterwards


def test_bad_stop_arguments(model) -> None:
    with pytest.raises(ValueError, match="stop_tokens"):
        model.generate([1], 3, stop_tokens=[999])
    with pytest.raises(ValueError, match="stop"):
        model.generate([1], 3, stop=[""])
    with pytest.raises(ValueError, match="l_warmup_loops"):
        model.generate([1], 3, loops=4, l_warmup_tokens=2, l_warmup_loops=5)
