"""The GPU's pipelined greedy loop (host one step ahead, tokens fed back on the device), run on the CPU:
same tokens, same stop behaviour and the same cache length afterwards as the plain loop."""

from __future__ import annotations

import pytest
import torch

from tinyloop.api.model import Model
from tinyloop.runtime import generate as gen
from tinyloop.runtime.generate import GenerationStats, stream_tokens
from tinyloop.sampling import SamplingParams

PROMPT = torch.tensor(list(b"Hello, looped world"), dtype=torch.long)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_files):
    with Model(tiny_files["f32"], max_seq_len=128) as m:
        yield m._engine


def _run(engine, pipelined: bool, max_tokens: int, stops=frozenset(), take: int | None = None):  # type: ignore[no-untyped-def]
    old = gen.PIPELINE_ON_CPU
    gen.PIPELINE_ON_CPU = pipelined
    try:
        cache = engine.new_cache(1, 128, 4)
        stats = GenerationStats()
        stream = stream_tokens(engine, cache, PROMPT, max_tokens, 4, GREEDY, stats, stop_tokens=stops)
        out = []
        for tok in stream:
            out.append(tok)
            if take is not None and len(out) == take:
                stream.close()
                break
        return out, int(cache.lengths[0]), stats.stop_reason, stats.generated_tokens, cache
    finally:
        gen.PIPELINE_ON_CPU = old


def test_same_tokens_and_cache_as_the_plain_loop(engine) -> None:  # type: ignore[no-untyped-def]
    plain = _run(engine, False, 24)
    piped = _run(engine, True, 24)
    assert piped[:4] == plain[:4] and len(piped[0]) == 24
    # The cache holds the same keys and values for every position it keeps.
    n = plain[1]
    assert torch.equal(piped[4].k[:, :, :, :n], plain[4].k[:, :, :, :n])


def test_stop_tokens_at_every_position(engine) -> None:  # type: ignore[no-untyped-def]
    full = _run(engine, False, 16)[0]
    for i in range(len(full)):
        stops = frozenset({full[i]})
        assert _run(engine, True, 16, stops)[:4] == _run(engine, False, 16, stops)[:4], i


@pytest.mark.parametrize("take", [1, 2, 7])
def test_closing_early_leaves_the_cache_like_the_plain_loop(engine, take: int) -> None:  # type: ignore[no-untyped-def]
    plain = _run(engine, False, 16, take=take)
    piped = _run(engine, True, 16, take=take)
    assert piped[0] == plain[0] and piped[1] == plain[1] and piped[3] == plain[3]


def test_one_and_zero_tokens(engine) -> None:  # type: ignore[no-untyped-def]
    for n in (0, 1):
        assert _run(engine, True, n)[:4] == _run(engine, False, n)[:4]
