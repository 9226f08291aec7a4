"""Generation of one request: the decode loop over a batch of one, or on a GPU the pipelined greedy loop."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from tinyloop.cache.base import StepCache
from tinyloop.cache.kv import KVCache
from tinyloop.errors import NonFiniteLogitsError
from tinyloop.grammar.index import TokenIndex
from tinyloop.runtime.decode import Row, decode_rows
from tinyloop.runtime.depth_schedule import DepthSchedule
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.stats import GenerationStats
from tinyloop.sampling import SamplingParams

__all__ = ["GenerationStats", "TokenPicker", "stream_tokens"]


# Tests switch the pipelined greedy loop on for CPU engines (it only pays on a GPU, where the host would
# otherwise wait for every token).
PIPELINE_ON_CPU = False


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
) -> Iterator[int]:
    """Yield up to max_tokens new ids. With cache None, every step recomputes the whole sequence.

    grammar: only tokens its index allows are sampled; generation ends when nothing can follow.
    stop_tokens: end generation when one is sampled (it is not yielded); under a grammar they are
    allowed only where the text so far fully matches. schedule: a depth schedule (see DepthSchedule;
    without a cache a shallow step recomputes the whole sequence shallow).
    """
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = int(prompt.numel())
    picker = TokenPicker(params, grammar, stop_tokens)
    pipelined = (
        (engine.device.type == "cuda" or PIPELINE_ON_CPU)
        and isinstance(cache, KVCache)  # rolls back one position exactly (not a sliding-window ring)
        and schedule is None
        and grammar is None
        and params.temperature == 0.0
        and params.logprobs is None  # recorded by the decode loop only
    )
    try:
        if pipelined:
            yield from _decode_pipelined(engine, cache, prompt, max_tokens, loops, picker, stats, schedule)
        else:
            row = Row(prompt, loops, max_tokens, picker, schedule, stats)
            yield from (token for _, token in decode_rows(engine, cache, [row]))
    except GeneratorExit:
        stats.stop_reason = stats.stop_reason or "closed"
        raise
    finally:
        stats.finished = picker.accepting()


def _decode_pipelined(
    engine: Engine,
    cache: StepCache | None,
    prompt: torch.Tensor,
    max_tokens: int,
    loops: int,
    picker: TokenPicker,
    stats: GenerationStats,
    schedule: DepthSchedule | None,
) -> Iterator[int]:
    """Greedy decoding on a GPU with the host one step ahead: each step's argmax stays on the device and
    feeds the next step directly, and the host reads token t (through a pinned buffer) only after it has
    queued step t + 1, so its per-token bookkeeping overlaps the GPU's work instead of idling it. Same
    tokens as `_decode`; a stop token costs one extra step, whose cache position is dropped again."""
    assert cache is not None and schedule is None
    if max_tokens == 0:
        stats.stop_reason = "max_tokens"
        return
    t0 = time.perf_counter()
    cache.truncate(0)
    logits = engine.step(prompt.to(torch.long).view(1, -1), cache, loops, last_only=True).logits
    assert logits is not None
    on_gpu = engine.device.type == "cuda"
    host = torch.empty(max_tokens, dtype=torch.long, pin_memory=on_gpu)
    ready: list[torch.cuda.Event] = []

    def queue_readback(step: int, next_token: torch.Tensor) -> None:
        host[step : step + 1].copy_(next_token, non_blocking=on_gpu)
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
            ready.append(event)

    next_token = _argmax_or_flag(logits[0, -1:])
    queue_readback(0, next_token)
    prompt_len = int(cache.lengths[0])
    t1 = time.perf_counter()
    try:
        for step in range(max_tokens):
            if step + 1 < max_tokens:  # queue step + 1 before waiting for token `step`
                logits = engine.step(next_token.clamp(min=0).view(1, 1), cache, loops, last_only=True).logits
                assert logits is not None
                next_token = _argmax_or_flag(logits[0, -1:])
                queue_readback(step + 1, next_token)
            if on_gpu:
                ready[step].synchronize()
            token = int(host[step])
            if token < 0:
                raise NonFiniteLogitsError()
            if step == 0:
                stats.prefill_s = time.perf_counter() - t0
                t1 = time.perf_counter()
            if token in picker.stop_tokens:
                stats.stop_reason = "stop_token"
                return
            stats.generated_tokens = step + 1
            if step:
                stats.decode_s = time.perf_counter() - t1
            yield token
        stats.stop_reason = "max_tokens"
    finally:
        # Leave the cache as the plain loop would: every yielded token fed but the last (all of them
        # when a stop token ended it), i.e. without the step queued ahead.
        n = stats.generated_tokens
        keep = n if stats.stop_reason == "stop_token" else max(n - 1, 0)
        cache.truncate(min(prompt_len + keep, int(cache.lengths[0])))


def _argmax_or_flag(logits: torch.Tensor) -> torch.Tensor:
    """argmax of logits [1, V] on the device, or -1 when they hold NaN or +inf (read by the host later)."""
    bad = torch.isnan(logits).any() | torch.isposinf(logits).any()
    return torch.where(bad, torch.full((1,), -1, device=logits.device), logits.argmax(-1))
