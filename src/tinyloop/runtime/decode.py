"""The decode loop: a batch of rows (requests) stepped together, each with its own state.

A row owns everything that belongs to its request: its tokens, sampler and seed, grammar state, stop
tokens, depth and depth schedule, and its statistics. The loop prefills every row in one step (or starts
a single row from a restored state), then runs one batched step per token; rows finish independently
(max_tokens, a stop token, the grammar's end, or `Row.finish` from the consumer, e.g. on a stop string).
A finished row rides along until the batch ends: it rewrites one position past its end, which nothing
reads, so the step keeps its shape.

With lookahead (on a GPU by default) the host runs one step ahead for rows whose next input needs no host
decision (greedy, no grammar, depth schedule, logprobs or own step, over a cache that rolls back exactly): each
step's argmax stays on the device and feeds the next step, which is queued before the host reads the tokens
back, so the host's bookkeeping overlaps the device's work. A row that finishes was fed one step too far; that
position is dropped again, so the cache ends as without lookahead.

The loop is three functions that the continuous-batching scheduler (runtime/scheduler.py) drives as
well: `begin` a row, `pick_tokens` from a step's logits, `decode_step` over the cache's rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field

import torch

from tinyloop.cache.base import StepCache
from tinyloop.cache.kv import KVCache
from tinyloop.runtime.adaptive_exit import ExitCriterion, adaptive_rows_step
from tinyloop.runtime.depth_schedule import DepthSchedule, fill_skipped_iterations
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import (
    TokenPicker,
    argmax_and_flagged,
    argmax_or_flag,
    drawn_tokens,
    filtered_probs_rows,
    token_logprob,
)
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


def decode_rows(
    engine: Engine, cache: StepCache | None, rows: Sequence[Row], *, lookahead: bool | None = None
) -> Generator[tuple[int, int], None, None]:
    """Yield (row index, token) as the rows generate them. With cache None every step recomputes the
    rows' whole sequences. The cache must have one row per request and hold max(row.loops) loops.
    lookahead: run the host one step ahead where the rows allow it (see the module); None: `engine.lookahead`."""
    for row in rows:
        begin(row)
    if all(row.done for row in rows):
        return
    loops = max(row.loops for row in rows)
    ahead = None
    if _can_look_ahead(cache, rows, engine.lookahead if lookahead is None else lookahead):
        ahead = _Lookahead(len(rows), engine.device.type == "cuda")
    logits = _first_logits(engine, cache, rows, loops)
    try:
        while True:
            if ahead is None:
                yield from pick_tokens(rows, logits)
            else:
                assert cache is not None
                ahead.settle(cache, rows)
                logits = ahead.queue(engine, cache, rows, loops, logits)
                yield from ahead.take(rows)
            if all(row.done for row in rows):
                return
            if ahead is None:
                logits = _next_logits(engine, cache, rows, loops)
    except GeneratorExit:
        for row in rows:
            row.finish("closed")
        raise
    finally:
        for row in rows:
            row.stats.finished = row.picker.accepting()
        if ahead is not None:
            assert cache is not None
            ahead.settle(cache, rows, ended=True)


def decode_row(engine: Engine, cache: StepCache | None, row: Row, *, lookahead: bool | None = None) -> Iterator[int]:
    """One request's tokens: `decode_rows` over a batch of one (closed with this iterator)."""
    with closing(decode_rows(engine, cache, [row], lookahead=lookahead)) as steps:
        yield from (token for _, token in steps)


def _next_logits(engine: Engine, cache: StepCache | None, rows: Sequence[Row], loops: int) -> torch.Tensor:
    own_step = rows[0].step
    if own_step is None:
        return decode_step(engine, cache, rows, loops)
    if len(rows) != 1:
        raise ValueError("a row with its own decode step runs in a batch of one")
    return own_step(rows[0].tokens[-1]).view(1, -1)


def _can_look_ahead(cache: StepCache | None, rows: Sequence[Row], lookahead: bool) -> bool:
    """Whether every row's next input is the device's argmax, over a cache that rolls back one position
    exactly (not a sliding-window ring)."""
    return (
        lookahead
        and isinstance(cache, KVCache)
        and all(
            row.picker.plain_greedy
            and row.picker.params.logprobs is None
            and row.schedule is None
            and row.exit is None
            and row.step is None
            for row in rows
        )
    )


class _Lookahead:
    """decode_rows' host one step ahead: the device's greedy tokens come back through one pinned buffer, read
    only after the next step is queued with them. `fed[b]`: the step queued ahead advanced row b's cache."""

    def __init__(self, batch: int, on_device: bool) -> None:
        self.host = torch.empty(batch, dtype=torch.long, pin_memory=on_device)
        self.ready = torch.cuda.Event() if on_device else None
        self.fed = [False] * batch

    def queue(
        self, engine: Engine, cache: StepCache, rows: Sequence[Row], loops: int, logits: torch.Tensor
    ) -> torch.Tensor:
        """Queue the readback of the tokens of logits [B, V] and, unless every row ends with them, the next
        step fed those tokens: its logits (else `logits`)."""
        tokens, flagged = argmax_and_flagged(logits)
        self.host.copy_(flagged, non_blocking=self.ready is not None)
        if self.ready is not None:
            self.ready.record()
        if not any(not row.done and len(row.tokens) + 1 < row.max_tokens for row in rows):
            self.fed = [False] * len(rows)
            return logits
        # Marked fed only once the step has run: a step that raises leaves nothing to settle, so its error
        # surfaces rather than settle's.
        next_logits = decode_step(engine, cache, rows, loops, feed=tokens)
        self.fed = [not row.done for row in rows]
        return next_logits

    def take(self, rows: Sequence[Row]) -> Iterator[tuple[int, int]]:
        """The queued tokens, taken by their live rows: yield (b, token)."""
        if self.ready is not None:
            self.ready.synchronize()
        for b, token in enumerate(self.host.tolist()):
            row = rows[b]
            if row.done:
                continue
            if record_token(row, row.picker.take(token)) is not None:
                yield b, token

    def settle(self, cache: StepCache, rows: Sequence[Row], ended: bool = False) -> None:
        """Drop the position the step queued ahead gave each row that has finished since (every row it
        advanced, once the loop `ended`), leaving the cache as the loop without lookahead would."""
        back = [fed and (ended or row.done) for fed, row in zip(self.fed, rows, strict=True)]
        if not any(back):
            return
        cache.lengths = cache.lengths - torch.tensor(back, dtype=torch.long)
        for b, row in enumerate(rows):
            if back[b]:
                self.fed[b] = False
                row.step_depths.pop()


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
    prepared = prepared_picks(rows, logits)
    for b, row in enumerate(rows):
        if row is not None and not row.done:
            token = pick_token(row, logits[b], prepared.get(b))
            if token is not None:
                yield b, token


def prepared_picks(
    rows: Sequence[Row | None], logits: torch.Tensor, *, sampled_in_batch: bool | None = None
) -> dict[int, int]:
    """What the live rows' pickers need from the device, computed for the batch at once instead of a few
    synchronising launches per row: plain-greedy rows' argmax; on a GPU, plain sampled rows' tokens, filtered
    and drawn on the device with one uniform from each row's generator (one transfer each way; `sampled_in_batch`
    says otherwise). -1 where a row's logits are non-finite."""
    live = [(b, row.picker) for b, row in enumerate(rows) if row is not None and not row.done]
    greedy = [b for b, picker in live if picker.plain_greedy]
    prepared: dict[int, int] = {}
    if greedy:
        picked = logits if len(greedy) == logits.shape[0] else logits[torch.tensor(greedy, device=logits.device)]
        prepared.update(zip(greedy, argmax_or_flag(picked).tolist(), strict=True))
    in_batch = logits.is_cuda if sampled_in_batch is None else sampled_in_batch
    sampled = [(b, picker) for b, picker in live if picker.plain_sampled] if in_batch else []
    if sampled:
        picked = logits[torch.tensor([b for b, _ in sampled], device=logits.device)]
        bad = torch.isnan(picked).any(-1) | torch.isposinf(picked).any(-1)
        settings = [(picker.params.temperature, picker.params.top_k, picker.params.top_p) for _, picker in sampled]
        probs = filtered_probs_rows(picked, settings)
        uniforms = torch.stack([picker.uniform() for _, picker in sampled]).to(probs.device)
        tokens = torch.where(bad, -1, drawn_tokens(probs, uniforms)).tolist()
        prepared.update((b, tokens[i]) for i, (b, _) in enumerate(sampled))
    return prepared


def pick_token(row: Row, logits: torch.Tensor, prepared: int | None = None) -> int | None:
    """Row's next token from its logits [V] (None: the row finished without one), with its bookkeeping.
    prepared: its part of `prepared_picks`, if taken."""
    token = record_token(row, row.picker.pick(logits, prepared))
    if token is not None and row.picker.params.logprobs is not None:
        row.stats.logprobs.append(token_logprob(logits, token, row.picker.params.logprobs))
    return token


def record_token(row: Row, token: int | None) -> int | None:
    """Row's bookkeeping for its next token (None: a stop token, which finishes it)."""
    if token is None:
        row.finish("stop_token")
        return None
    row.tokens.append(token)
    stats = row.stats
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


def decode_step(
    engine: Engine, cache: StepCache | None, rows: Sequence[Row | None], loops: int, feed: torch.Tensor | None = None
) -> torch.Tensor:
    """One token for every cache row: logits [B, V]. Row b of the cache belongs to rows[b]; a finished
    row, or a slot without a row (None), feeds a dummy token at its end, which nothing reads, and keeps
    its length. Each live row runs its own depth (`loops_at` its next decode step); `loops` (at least
    every live row's) sizes the step. With cache None every row's whole sequence is recomputed.
    feed: the tokens [B] (on the device) instead of each row's last one."""
    live = [row is not None and not row.done for row in rows]
    depth = [
        row.loops_at(len(row.tokens)) if row is not None and ok else loops for row, ok in zip(rows, live, strict=True)
    ]
    logits, ran = _step_rows(engine, cache, rows, live, loops, depth, feed)
    for b, row in enumerate(rows):
        if row is not None and live[b]:
            row.step_depths.append(ran[b])
    return logits


def _step_rows(
    engine: Engine,
    cache: StepCache | None,
    rows: Sequence[Row | None],
    live: list[bool],
    loops: int,
    depth: list[int],
    feed: torch.Tensor | None,
) -> tuple[torch.Tensor, Sequence[int]]:
    """decode_step's forward: (logits [B, V], iterations each row ran)."""
    depths = None if all(d == loops for d in depth) else _depth_tensor(depth)
    if cache is None:
        sequences = [row.prompt.tolist() + row.tokens if row is not None else [0] for row in rows]
        tokens, lengths = _padded(sequences)
        out = engine.step(tokens, None, loops, valid=lengths, last_only=True, depth=depths)
        assert out.logits is not None
        return out.logits[:, -1], depth
    last = [row.tokens[-1] if row is not None and row.tokens else 0 for row in rows] if feed is None else []
    before = None if all(live) else cache.lengths.clone()
    exits = [row.exit if row is not None and ok else None for row, ok in zip(rows, live, strict=True)]
    if any(e is not None for e in exits):
        fill_to = [row.loops if row is not None and ok else 1 for row, ok in zip(rows, live, strict=True)]
        logits, ran = adaptive_rows_step(engine, cache, last, depth, exits, fill_to)
    else:
        tokens = torch.tensor(last) if feed is None else feed
        out = engine.step(tokens.view(-1, 1), cache, loops, last_only=True, depth=depths)
        assert out.logits is not None
        logits, ran = out.logits[:, -1], depth
        for b, row in enumerate(rows):
            if row is not None and live[b] and depth[b] < row.loops:
                end = int(cache.lengths[b])
                fill_skipped_iterations(cache, depth[b], row.loops, end - 1, end, row=b if len(rows) > 1 else None)
    if before is not None:
        cache.lengths = torch.where(torch.tensor(live), cache.lengths, before)
    return logits, ran
