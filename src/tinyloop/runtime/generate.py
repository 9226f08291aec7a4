"""Autoregressive decoding over an engine: prefill, then one cached step per token."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tinyloop.cache.kv import KVCache
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

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from the prefill; each later one costs a decode step.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


def stream_tokens(
    engine: Engine,
    cache: KVCache | None,
    prompt: torch.Tensor,
    max_tokens: int,
    loops: int,
    params: SamplingParams,
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield up to max_tokens new ids. With cache None, every step recomputes the whole sequence."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = int(prompt.numel())
    if max_tokens == 0:
        return
    gen = params.generator()
    sync = engine.device.type == "cuda"
    t0 = time.perf_counter()
    sequence = prompt.to(torch.long).view(1, -1)
    if cache is not None:
        cache.truncate(0)
    logits = engine.step(sequence, cache, loops, last_only=True).logits
    assert logits is not None
    token = sample_next(logits[0, -1], params.temperature, params.top_k, params.top_p, gen)
    if sync:
        torch.cuda.synchronize()
    stats.prefill_s = time.perf_counter() - t0
    stats.generated_tokens = 1
    yield token
    t1 = time.perf_counter()
    for _ in range(max_tokens - 1):
        step_input = torch.tensor([[token]])
        if cache is None:
            sequence = torch.cat((sequence, step_input), dim=1)
            logits = engine.step(sequence, None, loops, last_only=True).logits
        else:
            logits = engine.step(step_input, cache, loops, last_only=True).logits
        assert logits is not None
        token = sample_next(logits[0, -1], params.temperature, params.top_k, params.top_p, gen)
        stats.generated_tokens += 1
        stats.decode_s = time.perf_counter() - t1
        yield token
