"""Autoregressive decoding over an engine: prefill, then one cached step per token."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tinyloop.cache.base import StepCache
from tinyloop.grammar.index import TokenIndex
from tinyloop.runtime.depth_schedule import DepthSchedule, fill_skipped_iterations
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import sample_next


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    seed: int | None = None

    def generator(self) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


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
    try:
        yield from _decode(engine, cache, prompt, max_tokens, loops, picker, stats, schedule)
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
