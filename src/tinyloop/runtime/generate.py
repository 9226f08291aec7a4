"""Autoregressive decoding over an engine: prefill, then one cached step per token."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tinyloop.cache.base import StepCache
from tinyloop.cache.kv import KVCache
from tinyloop.errors import NonFiniteLogitsError
from tinyloop.grammar.index import TokenIndex
from tinyloop.runtime.depth_schedule import DepthSchedule, fill_skipped_iterations
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import sample_next
from tinyloop.sampling import SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # Why generation ended: max_tokens, stop_token, stop_string, grammar_end (nothing else can follow),
    # or closed (the caller stopped iterating). finished is False when a grammar was still in a
    # non-accepting state at the end: the text is then only a prefix of a match.
    stop_reason: str = ""
    finished: bool = True

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from the prefill; each later one costs a decode step.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


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
    )
    decode = _decode_pipelined if pipelined else _decode
    try:
        yield from decode(engine, cache, prompt, max_tokens, loops, picker, stats, schedule)
    except GeneratorExit:
        stats.stop_reason = stats.stop_reason or "closed"
        raise
    finally:
        stats.finished = picker.accepting()


def _decode(
    engine: Engine,
    cache: StepCache | None,
    prompt: torch.Tensor,
    max_tokens: int,
    loops: int,
    picker: TokenPicker,
    stats: GenerationStats,
    schedule: DepthSchedule | None,
) -> Iterator[int]:
    if max_tokens == 0 or picker.done():
        stats.stop_reason = "max_tokens" if max_tokens == 0 else "grammar_end"
        return
    sync = engine.device.type == "cuda"
    t0 = time.perf_counter()
    sequence = prompt.to(torch.long).view(1, -1)
    if cache is not None:
        cache.truncate(0)
    logits = engine.step(sequence, cache, loops, last_only=True).logits
    assert logits is not None
    token = picker.pick(logits[0, -1])
    if sync:
        torch.cuda.synchronize()
    stats.prefill_s = time.perf_counter() - t0
    if token is None:
        stats.stop_reason = "stop_token"
        return
    stats.generated_tokens = 1
    yield token
    t1 = time.perf_counter()
    for step in range(1, max_tokens):
        if picker.done():
            stats.stop_reason = "grammar_end"
            return
        step_input = torch.tensor([[token]])
        n_loops = loops if schedule is None else schedule.loops_for(step, loops)
        if cache is None:
            sequence = torch.cat((sequence, step_input), dim=1)
            logits = engine.step(sequence, None, n_loops, last_only=True).logits
        else:
            logits = engine.step(step_input, cache, n_loops, last_only=True).logits
            if n_loops < loops:
                end = int(cache.lengths[0])
                fill_skipped_iterations(cache, n_loops, loops, end - 1, end)
        assert logits is not None
        token = picker.pick(logits[0, -1])
        if token is None:
            stats.stop_reason = "stop_token"
            return
        stats.generated_tokens += 1
        stats.decode_s = time.perf_counter() - t1
        yield token
    stats.stop_reason = "max_tokens"


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


class TokenPicker:
    """Samples next tokens under a grammar and stop tokens, and tracks the grammar state."""

    def __init__(self, params: SamplingParams, grammar: TokenIndex | None, stop_tokens: frozenset[int]) -> None:
        self.params = params
        self.gen = params.generator()
        self.grammar = grammar
        self.stop_tokens = stop_tokens
        self.state = grammar.initial if grammar is not None else 0
        self._stop_mask: torch.Tensor | None = None
        if grammar is not None and stop_tokens:
            self._stop_mask = torch.zeros(grammar.vocab_size, dtype=torch.bool, device=grammar.device)
            self._stop_mask[[t for t in stop_tokens if t < grammar.vocab_size]] = True

    def done(self, state: int | None = None) -> bool:
        return self.grammar is not None and self.grammar.is_done(self.state if state is None else state)

    def accepting(self) -> bool:
        return self.grammar is None or self.grammar.is_final(self.state)

    def constrain(self, logits: torch.Tensor, state: int | None = None) -> torch.Tensor:
        """Logits with every token the grammar forbids in `state` (default: the current one) at -inf."""
        if self.grammar is None:
            return logits
        state = self.state if state is None else state
        if self._stop_mask is not None and self.grammar.is_final(state):
            forbidden = ~(self.grammar.allowed(state) | self._stop_mask)
        else:
            forbidden = self.grammar.forbidden(state)
        return logits.masked_fill(forbidden.to(logits.device), float("-inf"))

    def pick(self, logits: torch.Tensor) -> int | None:
        """The next token, or None when a stop token was sampled."""
        p = self.params
        token = sample_next(self.constrain(logits), p.temperature, p.top_k, p.top_p, self.gen)
        if token in self.stop_tokens:
            return None
        if self.grammar is not None:
            self.state = self.grammar.advance(self.state, token)
        return token
