"""Decoding that starts from state a handle restored: the first logits come from a callback (a suffix
prefill, a deeper resumed pass, or stored logits), then one cached (or recomputed) step per token."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from tinyloop.cache.base import StepCache
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.generate import GenerationStats
from tinyloop.runtime.sampling import sample_next
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
    stats.prompt_tokens = int(sequence.numel())
    if max_tokens == 0:
        return
    gen = params.generator()
    sync = engine.device.type == "cuda"
    t0 = time.perf_counter()
    token = sample_next(first_logits(), params.temperature, params.top_k, params.top_p, gen)
    if sync:
        torch.cuda.synchronize()
    stats.prefill_s = time.perf_counter() - t0
    stats.generated_tokens = 1
    yield token
    seq = sequence.to(torch.long).view(1, -1)
    t1 = time.perf_counter()
    for _ in range(max_tokens - 1):
        step_input = torch.tensor([[token]])
        if cache is None:
            seq = torch.cat((seq, step_input), dim=1)
            logits = engine.step(seq, None, loops, last_only=True).logits
        else:
            logits = engine.step(step_input, cache, loops, last_only=True).logits
        assert logits is not None
        token = sample_next(logits[0, -1], params.temperature, params.top_k, params.top_p, gen)
        stats.generated_tokens += 1
        stats.decode_s = time.perf_counter() - t1
        yield token
