"""The decode loop: a batch of rows (requests) stepped together, each with its own state.

A row owns everything that belongs to its request: its tokens, sampler and seed, grammar state, stop
tokens, depth and depth schedule, and its statistics. The loop prefills every row in one step (or starts
a single row from a restored state), then runs one batched step per token; rows finish independently
(max_tokens, a stop token, the grammar's end, or `Row.finish` from the consumer, e.g. on a stop string).
A finished row rides along until the batch ends: it rewrites one position past its end, which nothing
reads, so the step keeps its shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tinyloop.cache.base import StepCache
from tinyloop.runtime.depth_schedule import DepthSchedule, fill_skipped_iterations
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.stats import GenerationStats


@dataclass(eq=False)
class Row:
    """One request in the loop. prompt: all tokens before the first new one ([n] ids).

    start: for a row that resumes from stored state (prefix cache, pool, resume handle; batch of one):
    makes the cache hold the prompt and returns the next-token logits [V], instead of the prefill.
    """

    prompt: torch.Tensor
    loops: int
    max_tokens: int
    picker: TokenPicker
    schedule: DepthSchedule | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    start: Callable[[], torch.Tensor] | None = None
    tokens: list[int] = field(default_factory=list)
    done: bool = False

    def finish(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.stats.stop_reason = self.stats.stop_reason or reason
        self.stats.finished = self.picker.accepting()

    def loops_at(self, step: int) -> int:
        """Iterations for decode step `step` (1-based)."""
        return self.loops if self.schedule is None else self.schedule.loops_for(step, self.loops)


def decode_rows(engine: Engine, cache: StepCache | None, rows: Sequence[Row]) -> Iterator[tuple[int, int]]:
    """Yield (row index, token) as the rows generate them. With cache None every step recomputes the
    rows' whole sequences. The cache must have one row per request and hold max(row.loops) loops."""
    for row in rows:
        row.stats.prompt_tokens = int(row.prompt.numel())
        if row.max_tokens == 0:
            row.finish("max_tokens")
        elif row.picker.done():
            row.finish("grammar_end")
    if all(row.done for row in rows):
        return
    loops = max(row.loops for row in rows)
    sequences = [row.prompt.to(torch.long).tolist() for row in rows]
    t0 = time.perf_counter()
    logits = _first_logits(engine, cache, rows, loops)
    step = 0
    t1 = time.perf_counter()
    while True:
        for b, row in enumerate(rows):
            if row.done:
                continue
            token = row.picker.pick(logits[b])
            if token is None:
                row.finish("stop_token")
                continue
            row.tokens.append(token)
            sequences[b].append(token)
            stats = row.stats
            stats.generated_tokens += 1
            if step == 0:
                stats.prefill_s = time.perf_counter() - t0
            else:
                stats.decode_s = time.perf_counter() - t1
            yield b, token
            if len(row.tokens) >= row.max_tokens:
                row.finish("max_tokens")
            elif row.picker.done():
                row.finish("grammar_end")
        if all(row.done for row in rows):
            return
        if step == 0:
            t1 = time.perf_counter()
        step += 1
        depth = [row.loops_at(step) for row in rows]
        logits = _decode_step(engine, cache, rows, sequences, loops, depth)


def _depth_tensor(depth: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(depth), dtype=torch.long)


def _padded(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, T] and each row's length [B]."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    out = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for b, s in enumerate(sequences):
        out[b, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out, lengths


def _first_logits(engine: Engine, cache: StepCache | None, rows: Sequence[Row], loops: int) -> torch.Tensor:
    """Next-token logits [B, V] after each row's prompt."""
    if rows[0].start is not None:
        if len(rows) != 1:
            raise ValueError("a row that starts from stored state runs in a batch of one")
        return rows[0].start().view(1, -1)
    tokens, lengths = _padded([row.prompt.tolist() for row in rows])
    if cache is not None:
        cache.truncate(0)
    depth = _depth_tensor([row.loops for row in rows])
    out = engine.step(tokens, cache, loops, valid=lengths, last_only=True, depth=depth)
    assert out.logits is not None
    return out.logits[:, -1]


def _decode_step(
    engine: Engine,
    cache: StepCache | None,
    rows: Sequence[Row],
    sequences: Sequence[Sequence[int]],
    loops: int,
    depth: Sequence[int],
) -> torch.Tensor:
    """One token for every row (a finished row repeats its last one, which nothing reads): logits [B, V]."""
    depths = _depth_tensor(depth)
    if cache is None:
        tokens, lengths = _padded(sequences)
        out = engine.step(tokens, None, loops, valid=lengths, last_only=True, depth=depths)
        assert out.logits is not None
        return out.logits[:, -1]
    feed = torch.tensor([[row.tokens[-1] if row.tokens else 0] for row in rows], dtype=torch.long)
    before = cache.lengths.clone()
    out = engine.step(feed, cache, loops, last_only=True, depth=depths)
    assert out.logits is not None
    finished = torch.tensor([row.done for row in rows])
    if bool(finished.any()):
        cache.lengths = torch.where(finished, before, cache.lengths)
    for b, row in enumerate(rows):
        if not row.done and depth[b] < row.loops:
            end = int(cache.lengths[b])
            fill_skipped_iterations(cache, depth[b], row.loops, end - 1, end, row=b if len(rows) > 1 else None)
    return out.logits[:, -1]
