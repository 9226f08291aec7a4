"""Generation of one request: the decode loop over a batch of one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

import torch

from tinyloop.cache.base import StepCache
from tinyloop.grammar.index import TokenIndex
from tinyloop.runtime.decode import Row, decode_rows
from tinyloop.runtime.depth_schedule import DepthSchedule
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.stats import GenerationStats
from tinyloop.sampling import SamplingParams

__all__ = ["GenerationStats", "TokenPicker", "stream_tokens"]


def stream_tokens(
    engine: Engine,
    cache: StepCache | None,
    prompt: torch.Tensor,
    max_tokens: int,
    loops: int,
    params: SamplingParams,
    stats: GenerationStats | None = None,
    *,
    grammar: TokenIndex | None = None,
    stop_tokens: frozenset[int] = frozenset(),
    schedule: DepthSchedule | None = None,
    lookahead: bool | None = None,
) -> Iterator[int]:
    """Yield up to max_tokens new ids. With cache None, every step recomputes the whole sequence.

    grammar: only tokens its index allows are sampled; generation ends when nothing can follow.
    stop_tokens: end generation when one is sampled (it is not yielded); under a grammar they are
    allowed only where the text so far fully matches. schedule: a depth schedule (see DepthSchedule;
    without a cache a shallow step recomputes the whole sequence shallow). lookahead: as in `decode_rows`.
    """
    stats = stats if stats is not None else GenerationStats()
    picker = TokenPicker(params, grammar, stop_tokens)
    row = Row(prompt, loops, max_tokens, picker, schedule, stats)
    try:
        with closing(decode_rows(engine, cache, [row], lookahead=lookahead)) as steps:
            yield from (token for _, token in steps)
    except GeneratorExit:
        stats.stop_reason = stats.stop_reason or "closed"
        raise
    finally:
        stats.finished = picker.accepting()
