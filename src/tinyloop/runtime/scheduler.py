"""Continuous batching: requests join and leave a fixed set of cache rows (slots) while others decode.

Each step (on one engine thread, or driven by the caller through `step()`):
1. drop aborted requests (their slots are free before the step runs);
2. admit waiting requests into free slots: prefill their prompts in a one-row staging cache, a chunk at a
   time under a per-step token budget (so running rows keep streaming while a long prompt is read), after
   starting from the longest prefix the prefix pool holds; a finished prefill is copied into the slot, its
   first token sampled, and the prompt offered to the pool;
3. one batched decode step (`runtime.decode.decode_step`, the decode loop's own step) over every slot:
   rows sit at their own positions and depths; empty slots ride along;
4. free the rows that finished.

Slots and the staging cache are allocated once (fixed shapes, bucketable later); waiting requests are
bounded by max_queue, so memory never grows with the load.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tinyloop.cache.base import ModeCache, copy_out
from tinyloop.cache.pool import PrefixPool, content_key
from tinyloop.errors import QueueFullError
from tinyloop.runtime.decode import Row, begin, decode_step, pick_token, prepared_picks
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.requests import Request, RequestHandle


class PoolEntry(Protocol):
    """What the scheduler reads from a prefix-pool entry (a tinyloop.PrefixCache)."""

    tokens: np.ndarray

    def kv(self) -> dict[str, torch.Tensor] | None: ...

    def last_logits(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class PrefixHooks:
    """The prefix pool and what the scheduler needs to use it for one model: its cache identity, whether
    a snapshot serves a truncated prefix in this KV mode, and how to wrap a snapshot as a pool entry."""

    pool: PrefixPool
    model_key: str
    usable: Callable[[int, int], bool]
    make_entry: Callable[[np.ndarray, int, dict[str, torch.Tensor], torch.Tensor], Any]


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch: int
    max_seq_len: int
    max_loops: int
    max_queue: int
    prefill_chunk_tokens: int


class SlotScheduler:
    """The scheduling loop over one engine's slots; `tinyloop.Scheduler` builds its requests."""

    def __init__(
        self,
        engine: Engine,
        new_cache: Callable[[int], ModeCache | None],
        limits: SchedulerLimits,
        prefix: PrefixHooks | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.prefix = prefix
        self.slots = new_cache(limits.max_batch)  # None: kv_mode 'none' (every step recomputes the rows)
        self.staging = new_cache(1) if self.slots is not None else None
        self._rows: list[Request | None] = [None] * limits.max_batch
        self._prefilling: Request | None = None
        self._waiting: deque[Request] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain = True
        self._closed = False
        self._counts = dict.fromkeys(
            ("prompt_tokens", "generated_tokens", "prefix_hit_requests", "prefix_hit_tokens", "finished",
             "aborted", "failed", "decode_steps", "decode_rows", "decode_iterations"), 0,
        )  # fmt: skip

    # ---- caller side (any thread) -------------------------------------------------------------
    def _enqueue(self, request: Request) -> RequestHandle:
        with self._cond:
            if self._closed or self._stopping:
                raise RuntimeError("the scheduler was stopped; create a new one to submit requests")
            if len(self._waiting) >= self.limits.max_queue:
                raise QueueFullError(
                    f"the scheduler's queue is full ({self.limits.max_queue} waiting requests, max_queue); "
                    "retry later or create the Scheduler with a larger max_queue"
                )
            self._waiting.append(request)
            self._cond.notify_all()
        return request.handle

    def abort(self, handle: RequestHandle) -> None:
        """End a request now: it reports finish_reason 'abort' and its slot is free before the next step.
        Aborting a finished request does nothing."""
        with self._cond:
            for req in self._waiting:
                if req.handle is handle:
                    self._waiting.remove(req)
                    self._count_abort(req)
                    return
            for held in (*self._rows, self._prefilling):
                if held is not None and held.handle is handle and not held.aborted:
                    held.aborted = True
                    self._count_abort(held)
                    self._cond.notify_all()
                    return

    def _count_abort(self, req: Request) -> None:
        if req.handle._finish("abort"):
            self._counts["aborted"] += 1

    def stats(self) -> dict[str, int]:
        """running (requests in slots or prefilling), waiting, and totals since creation: prompt and
        generated tokens, prefix-pool hits (requests / tokens), finished, aborted, failed, decode steps
        and the rows they decoded (their ratio is the mean batch size), and the loop iterations those steps
        ran (each runs until its deepest row is done: rows that exit early ride along)."""
        with self._cond:
            running = sum(r is not None for r in self._rows) + (self._prefilling is not None)
            return {"running": running, "waiting": len(self._waiting), **self._counts}

    def start(self) -> None:
        """Run the loop on one engine thread (until stop())."""
        with self._cond:
            if self._closed or self._stopping:
                raise RuntimeError("the scheduler was stopped; create a new one")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="tinyloop-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None, drain: bool = True) -> None:
        """Stop accepting requests and end the loop. drain: finish every submitted request first (after
        `timeout` seconds, abort what is left); otherwise abort them all at once. Joins the engine thread
        (a scheduler never started drains by stepping in the calling thread)."""
        with self._cond:
            self._stopping = True
            self._drain = drain
            thread = self._thread
            if not drain:
                self._abort_all()
            self._cond.notify_all()
        if thread is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while drain and self._has_work() and (deadline is None or time.monotonic() < deadline):
                self.step()
        else:
            thread.join(timeout)
            if thread.is_alive():
                with self._cond:
                    self._drain = False
                    self._abort_all()
                    self._cond.notify_all()
                thread.join()
        with self._cond:
            self._abort_all()
            self._closed = True

    def _abort_all(self) -> None:
        while self._waiting:
            self._count_abort(self._waiting.popleft())
        for req in (*self._rows, self._prefilling):
            if req is not None and not req.aborted:
                req.aborted = True
                self._count_abort(req)

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(drain=exc_type is None)

    # ---- engine side (one thread) -------------------------------------------------------------
    def _has_work(self) -> bool:
        with self._cond:
            return bool(self._waiting) or self._prefilling is not None or any(r is not None for r in self._rows)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._cond.wait()
                if self._stopping and (not self._drain or not self._has_work()):
                    return
            try:
                self.step()
            except Exception as exc:  # never leave callers waiting on a dead thread
                self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            self._prefilling = None
        for req in waiting:
            if req.handle._finish("error", exc):
                with self._cond:
                    self._counts["failed"] += 1
        for b, held in enumerate(self._rows):
            if held is not None:
                self._fail(held, exc)
                with self._cond:
                    self._rows[b] = None
        if self.slots is not None:
            self.slots.truncate(0)

    def step(self) -> None:
        """One scheduler step. Called by the engine thread; call it yourself only without start()."""
        if threading.current_thread() is not self._thread and self._thread is not None:
            raise RuntimeError("the scheduler runs on its engine thread; step() is for schedulers not started")
        self._drop_aborted()
        budget = self.limits.prefill_chunk_tokens
        while budget > 0:
            req = self._prefilling or self._admit()
            if req is None:
                break
            budget -= self._prefill(req, budget)
        if any(row is not None and not row.done for row in self._decoding()):
            self._decode()
        self._free_finished()

    def _drop_aborted(self) -> None:
        with self._cond:
            if self._prefilling is not None and self._prefilling.aborted:
                self._prefilling = None
            for b, req in enumerate(self._rows):
                if req is not None and req.aborted:
                    self._release(b)

    def _admit(self) -> Request | None:
        """The next waiting request, if a slot is free: it starts prefilling (returned)."""
        while True:
            with self._cond:
                if not self._waiting or None not in self._rows:
                    return None
                req = self._waiting.popleft()
                req.slot = self._rows.index(None)
                self._rows[req.slot] = req  # reserved: the slot's row is written when the prefill ends
                self._prefilling = req
            begin(req.row)
            if not req.row.done:
                self._start_from_pool(req)
                return req
            self._prefilling = None  # done at once (max_tokens 0, a grammar that accepts nothing): freed below

    def _start_from_pool(self, req: Request) -> None:
        hooks, staging = self.prefix, self.staging
        if staging is not None:
            staging.truncate(0)
        if hooks is None or staging is None:
            return
        row = req.row
        ids = row.prompt.numpy()
        match = hooks.pool.lookup(ids, row.loops, hooks.model_key, hooks.usable)
        if match is None:
            return
        entry: PoolEntry = match.item
        kv = entry.kv()
        assert kv is not None
        staging.restore(kv, len(entry.tokens), row.loops, match.reuse)
        req.prefilled = match.reuse
        req.handle.stats.prefix_hit_tokens = match.reuse
        with self._cond:
            self._counts["prefix_hit_requests"] += 1
            self._counts["prefix_hit_tokens"] += match.reuse
        if match.exact:
            req.first_logits = entry.last_logits()

    def _prefill(self, req: Request, budget: int) -> int:
        """Prefill up to `budget` more prompt tokens of `req`; returns the tokens computed."""
        row, n = req.row, int(req.row.prompt.numel())
        chunk = 0
        try:
            logits = req.first_logits
            if logits is None:
                if self.staging is None:  # no cache: the whole prompt at once
                    chunk = n
                    out = self.engine.step(row.prompt.view(1, -1), None, row.loops, last_only=True)
                else:
                    chunk = min(budget, n - req.prefilled)
                    piece = row.prompt[req.prefilled : req.prefilled + chunk].view(1, -1)
                    out = self.engine.step(piece, self.staging, row.loops, last_only=True)
                req.prefilled += chunk
                if req.prefilled < n:
                    return chunk
                assert out.logits is not None
                logits = out.logits[0, -1]
            self._prefilling = None
            self._place(req, logits)
            token = pick_token(row, logits)
        except Exception as exc:  # this request fails; the others go on
            self._prefilling = None
            self._fail(req, exc)
            return max(chunk, 1)
        with self._cond:
            self._counts["prompt_tokens"] += n
        if token is not None:
            self._emit(req, token)
        return max(chunk, 1)

    def _place(self, req: Request, logits: torch.Tensor) -> None:
        """Copy the finished prefill into the request's slot and offer the prompt to the pool."""
        staging, slots, hooks = self.staging, self.slots, self.prefix
        if staging is None or slots is None:
            return
        row, n = req.row, int(req.row.prompt.numel())
        kv = staging.snapshot(n, row.loops)
        slots.restore(kv, n, row.loops, n, row=req.slot)
        if hooks is None:
            return
        ids = row.prompt.numpy().astype(np.int32)
        if content_key(hooks.model_key, row.loops, ids) in hooks.pool:
            return
        entry = hooks.make_entry(ids, row.loops, kv, copy_out(logits, "prefix logits"))
        if entry.nbytes <= hooks.pool.max_bytes:
            hooks.pool.register(entry)

    def _decoding(self) -> list[Row | None]:
        """Each slot's row while it decodes (None: empty, reserved for a prefill, or aborted)."""
        return [None if r is None or r.aborted or r is self._prefilling else r.row for r in self._rows]

    def _decode(self) -> None:
        rows = self._decoding()
        live = [b for b, row in enumerate(rows) if row is not None and not row.done]
        loops = max(rows[b].loops for b in live)  # type: ignore[union-attr]
        # The step covers the leading slots up to the last live row, rounded up to a power of two (the
        # bucket a captured graph would serve): new requests take the lowest free slot.
        n = min(1 << (live[-1]).bit_length(), len(rows))
        rows = rows[:n]
        try:
            slots = self.slots
            if slots is None or n == len(self._rows):
                logits = decode_step(self.engine, slots, rows, loops)
            else:
                view = slots.leading(n)
                logits = decode_step(self.engine, view, rows, loops)
                slots.absorb(view)
        except Exception as exc:  # a failed step fails every request in it
            for b in live:
                req = self._rows[b]
                assert req is not None
                self._fail(req, exc)
            return
        with self._cond:
            self._counts["decode_steps"] += 1
            self._counts["decode_rows"] += len(live)
            self._counts["decode_iterations"] += max(rows[b].step_depths[-1] for b in live)  # type: ignore[union-attr]
        prepared = prepared_picks(rows, logits)
        for b, req in enumerate(self._rows[:n]):
            if req is None or req.row.done or rows[b] is None:
                continue
            try:
                token = pick_token(req.row, logits[b], prepared.get(b))
            except Exception as exc:
                self._fail(req, exc)
                continue
            if token is not None:
                self._emit(req, token)

    def _emit(self, req: Request, token: int) -> None:
        with self._cond:
            self._counts["generated_tokens"] += 1
        req.emit(token)

    def _fail(self, req: Request, exc: Exception) -> None:
        req.row.finish("error")
        if req.handle._finish("error", exc):
            with self._cond:
                self._counts["failed"] += 1
        if self.slots is not None and req.slot >= 0:
            self.slots.clear_row(req.slot)  # whatever it wrote (NaN, say) is never read again
        req.aborted = True

    def _free_finished(self) -> None:
        with self._cond:
            for b, req in enumerate(self._rows):
                if req is None or req is self._prefilling:
                    continue
                if req.row.done and not req.aborted:
                    req.complete()
                    if req.handle.finish_reason != "abort":
                        self._counts["finished"] += 1
                    self._release(b)
                elif req.aborted:
                    self._release(b)

    def _release(self, b: int) -> None:
        self._rows[b] = None
        if self.slots is not None:
            lengths = self.slots.lengths.clone()
            lengths[b] = 0  # an empty slot rides along at position 0
            self.slots.truncate(lengths)
