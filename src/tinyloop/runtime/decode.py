"""The decode loop: a batch of rows (requests) stepped together, each with its own state.

A row owns everything that belongs to its request: its tokens, sampler and seed, grammar state, stop
tokens, depth and depth schedule, and its statistics. The loop prefills every row in one step (or starts
a single row from a restored state), then runs one batched step per token; rows finish independently
(max_tokens, a stop token, the grammar's end, or `Row.finish` from the consumer, e.g. on a stop string).
A finished row rides along until the batch ends: it rewrites one position past its end, which nothing
reads, so the step keeps its shape.

The loop is three functions that the continuous-batching scheduler (runtime/scheduler.py) drives as
well: `begin` a row, `pick_tokens` from a step's logits, `decode_step` over the cache's rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tinyloop.cache.base import StepCache
from tinyloop.runtime.adaptive_exit import ExitCriterion, adaptive_rows_step
from tinyloop.runtime.depth_schedule import DepthSchedule, fill_skipped_iterations
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import TokenPicker, argmax_or_flag, token_logprob
from tinyloop.runtime.stats import GenerationStats


@dataclass(eq=False)
class Row:
    """One request in the loop. prompt: all tokens before the first new one ([n] ids).

    start: for a row that resumes from stored state (prefix cache, pool, resume handle; batch of one):
    makes the cache hold the prompt and returns the next-token logits [V], instead of the prefill.
    step: a row's own decode step (batch of one), token -> logits [V], e.g. the families' adaptive exit.
    """

    prompt: torch.Tensor
    loops: int
    max_tokens: int
    picker: TokenPicker
    schedule: DepthSchedule | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    start: Callable[[], torch.Tensor] | None = None
    step: Callable[[int], torch.Tensor] | None = None
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    exit: ExitCriterion | None = None  # per-token adaptive depth: decode steps stop iterating when it fires
    step_depths: list[int] = field(default_factory=list)  # iterations each decode step ran for this row
    started: float = 0.0  # perf_counter when the row began (its prefill)
    first_at: float = 0.0  # perf_counter when its first token came

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
        begin(row)
    if all(row.done for row in rows):
        return
    loops = max(row.loops for row in rows)
    logits = _first_logits(engine, cache, rows, loops)
    while True:
        yield from pick_tokens(rows, logits)
        if all(row.done for row in rows):
            return
        own_step = rows[0].step
        if own_step is None:
            logits = decode_step(engine, cache, rows, loops)
        elif len(rows) == 1:
            logits = own_step(rows[0].tokens[-1]).view(1, -1)
        else:
            raise ValueError("a row with its own decode step runs in a batch of one")


def begin(row: Row) -> None:
    """Start a row's clock and finish it at once if it can produce nothing (max_tokens 0, grammar done)."""
    row.stats.prompt_tokens = int(row.prompt.numel())
    row.started = time.perf_counter()
    if row.max_tokens == 0:
        row.finish("max_tokens")
    elif row.picker.done():
        row.finish("grammar_end")


def pick_tokens(rows: Sequence[Row | None], logits: torch.Tensor) -> Iterator[tuple[int, int]]:
    """Sample each live row's next token from logits [B, V] (row b from logits[b]); yield (b, token)."""
    greedy = greedy_picks(rows, logits)
    for b, row in enumerate(rows):
        if row is not None and not row.done:
            token = pick_token(row, logits[b], greedy.get(b))
            if token is not None:
                yield b, token


def greedy_picks(rows: Sequence[Row | None], logits: torch.Tensor) -> dict[int, int]:
    """The argmax (-1: non-finite) of every live plain-greedy row's logits, in one device computation and
    one readback instead of a few synchronising kernels per row."""
    chosen = [b for b, row in enumerate(rows) if row is not None and not row.done and row.picker.plain_greedy]
    if not chosen:
        return {}
    picked = logits if len(chosen) == logits.shape[0] else logits[torch.tensor(chosen, device=logits.device)]
    return dict(zip(chosen, argmax_or_flag(picked).tolist(), strict=True))


def pick_token(row: Row, logits: torch.Tensor, greedy_token: int | None = None) -> int | None:
    """Row's next token from its logits [V] (None: the row finished without one), with its bookkeeping.
    greedy_token: its argmax from `greedy_picks`, if taken."""
    token = row.picker.pick(logits, greedy_token)
    if token is None:
        row.finish("stop_token")
        return None
    row.tokens.append(token)
    stats = row.stats
    if row.picker.params.logprobs is not None:
        stats.logprobs.append(token_logprob(logits, token, row.picker.params.logprobs))
    stats.generated_tokens += 1
    now = time.perf_counter()
    if stats.generated_tokens == 1:
        stats.prefill_s = now - row.started
        row.first_at = now
    else:
        stats.decode_s = now - row.first_at
    if len(row.tokens) >= row.max_tokens:
        row.finish("max_tokens")
    elif row.picker.done():
        row.finish("grammar_end")
    return token


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


def decode_step(engine: Engine, cache: StepCache | None, rows: Sequence[Row | None], loops: int) -> torch.Tensor:
    """One token for every cache row: logits [B, V]. Row b of the cache belongs to rows[b]; a finished
    row, or a slot without a row (None), feeds a dummy token at its end, which nothing reads, and keeps
    its length. Each live row runs its own depth (`loops_at` its next decode step); `loops` (at least
    every live row's) sizes the step. With cache None every row's whole sequence is recomputed."""
    live = [row is not None and not row.done for row in rows]
    depth = [
        row.loops_at(len(row.tokens)) if row is not None and ok else loops for row, ok in zip(rows, live, strict=True)
    ]
    logits, ran = _step_rows(engine, cache, rows, live, loops, depth)
    for b, row in enumerate(rows):
        if row is not None and live[b]:
            row.step_depths.append(ran[b])
    return logits


def _step_rows(
    engine: Engine, cache: StepCache | None, rows: Sequence[Row | None], live: list[bool], loops: int, depth: list[int]
) -> tuple[torch.Tensor, Sequence[int]]:
    """decode_step's forward: (logits [B, V], iterations each row ran)."""
    depths = _depth_tensor(depth)
    if cache is None:
        sequences = [row.prompt.tolist() + row.tokens if row is not None else [0] for row in rows]
        tokens, lengths = _padded(sequences)
        out = engine.step(tokens, None, loops, valid=lengths, last_only=True, depth=depths)
        assert out.logits is not None
        return out.logits[:, -1], depth
    feed = [row.tokens[-1] if row is not None and row.tokens else 0 for row in rows]
    before = cache.lengths.clone()
    exits = [row.exit if row is not None and ok else None for row, ok in zip(rows, live, strict=True)]
    if any(e is not None for e in exits):
        fill_to = [row.loops if row is not None and ok else 1 for row, ok in zip(rows, live, strict=True)]
        logits, ran = adaptive_rows_step(engine, cache, feed, depth, exits, fill_to)
    else:
        out = engine.step(torch.tensor(feed, dtype=torch.long).view(-1, 1), cache, loops, last_only=True, depth=depths)
        assert out.logits is not None
        logits, ran = out.logits[:, -1], depth
        for b, row in enumerate(rows):
            if row is not None and live[b] and depth[b] < row.loops:
                end = int(cache.lengths[b])
                fill_skipped_iterations(cache, depth[b], row.loops, end - 1, end, row=b if len(rows) > 1 else None)
    finished = ~torch.tensor(live)
    if bool(finished.any()):
        cache.lengths = torch.where(finished, before, cache.lengths)
    return logits, ran
