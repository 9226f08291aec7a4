"""Decoding that starts from state a handle restored: the first logits come from a callback (a suffix
prefill, a deeper resumed pass, or stored logits), then the decode loop as for any request."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from tinyloop.cache.base import StepCache
from tinyloop.runtime.decode import Row, decode_row
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.stats import GenerationStats
from tinyloop.sampling import SamplingParams


def continue_tokens(
    engine: Engine,
    cache: StepCache | None,
    sequence: torch.Tensor,
    first_logits: Callable[[], torch.Tensor],
    max_tokens: int,
    loops: int,
    params: SamplingParams,
    stats: GenerationStats,
) -> Iterator[int]:
    """Yield up to max_tokens ids after `sequence` (all tokens so far, [n]).

    first_logits() prepares the cache to hold the whole sequence and returns the next-token logits [V];
    it runs lazily, on the first next(). With cache None every later step recomputes the sequence.
    """
    row = Row(sequence, loops, max_tokens, TokenPicker(params, None, params.stop_tokens), stats=stats,
              start=first_logits)  # fmt: skip
    yield from decode_row(engine, cache, row)
