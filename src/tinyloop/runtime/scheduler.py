"""Continuous batching: requests join and leave a fixed set of cache rows (slots) while others decode.

Each step (on one engine thread, or driven by the caller through `step()`):
1. drop aborted requests (their slots are free before the step runs);
2. admit waiting requests into free slots and prefill their prompts under a per-step token budget (so
   running rows keep streaming while long prompts are read; a prompt the budget cuts goes on next step), in
   rounds of up to `prefill_rows` prompts, one row each of a staging cache, each starting from the longest
   prefix the prefix pool holds. On a GPU a round is one batched forward (a prefill step costs about the same
   host time whether it reads one prompt or eight); on a CPU, whose steps are bound by their arithmetic, one
   forward per prompt. A finished prefill is copied into its slot, its first token sampled, and the prompt
   offered to the pool;
3. one batched decode step (`runtime.decode.decode_step`, the decode loop's own step) over every slot:
   rows sit at their own positions and depths; empty slots ride along;
4. free the rows that finished.

Slots and the staging cache are allocated once (fixed shapes, bucketable later); waiting requests are
bounded by max_queue, so memory never grows with the load.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tinyloop.cache.base import ModeCache, empty_row
from tinyloop.errors import QueueFullError
from tinyloop.runtime.decode import Row, begin, decode_step, pick_token, prepared_picks
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.prefix_hooks import PoolEntry, PrefixHooks
from tinyloop.runtime.requests import Request, RequestHandle
from tinyloop.runtime.staged_prefill import StagedPrefill


def step_rows(last_live: int, max_batch: int) -> int:
    """The slots a decode step covers: the leading ones up to the last live row (`last_live`), rounded up to
    a power of two (the bucket a captured graph would serve), at most max_batch."""
    return min(1 << last_live.bit_length(), max_batch)


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch: int
    max_seq_len: int
    max_loops: int
    max_queue: int
    prefill_chunk_tokens: int
    prefill_rows: int


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
        self.prefill = StagedPrefill(engine, new_cache(limits.prefill_rows) if self.slots is not None else None)
        self._rows: list[Request | None] = [None] * limits.max_batch
        self._prefilling: list[Request] = []  # admitted, prompt not yet in the slot (at most one after a step)
        self._waiting: deque[Request] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain = True
        self._closed = False
        self._warming_up = False
        self.decoded_buckets: Counter[tuple[int, int]] = Counter()  # decode steps per (slots stepped, loops)
        self._counts = dict.fromkeys(
            ("prompt_tokens", "generated_tokens", "prefix_hit_requests", "prefix_hit_tokens", "finished",
             "aborted", "failed", "prefill_steps", "prefill_rows", "decode_steps", "decode_rows",
             "decode_iterations"), 0,
        )  # fmt: skip

    # ---- caller side (any thread) -------------------------------------------------------------
    def _enqueue(self, request: Request) -> RequestHandle:
        with self._cond:
            if self._closed or self._stopping:
                raise RuntimeError("the scheduler was stopped; create a new one to submit requests")
            if self._warming_up:
                raise RuntimeError("the scheduler is warming up; submit requests once warm_up() has returned")
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
            for held in self._rows:
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
        generated tokens, prefix-pool hits (requests / tokens), finished, aborted, failed, prefill steps and
        the prompt chunks they ran together, decode steps and the rows they decoded (their ratio is the mean
        batch size), and the loop iterations those steps ran (each runs until its deepest row is done: rows
        that exit early ride along)."""
        with self._cond:
            running = sum(r is not None for r in self._rows)
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
            self._cond.notify_all()

    def _abort_all(self) -> None:
        while self._waiting:
            self._count_abort(self._waiting.popleft())
        for req in self._rows:
            if req is not None and not req.aborted:
                req.aborted = True
                self._count_abort(req)

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(drain=exc_type is None)

    @contextlib.contextmanager
    def _untraced(self) -> Iterator[None]:
        """Requests run inside leave no trace (a warm-up's): on an idle scheduler only, submissions refused
        meanwhile, nothing read from or offered to the prefix pool, `stats()` afterwards as before."""
        with self._cond:
            if self._closed or self._stopping:
                raise RuntimeError("the scheduler was stopped; create a new one to warm up")
            if self._warming_up:
                raise RuntimeError("the scheduler is already warming up")
            running = sum(r is not None for r in self._rows)
            if running or self._waiting:
                raise RuntimeError(f"warm_up needs an idle scheduler, but {running} requests are running and "
                                   f"{len(self._waiting)} waiting; warm it up before submitting requests")  # fmt: skip
            self._warming_up = True
            counts, prefix, self.prefix = dict(self._counts), self.prefix, None
        try:
            yield
        finally:
            with self._cond:
                self._counts.update(counts)
                self.prefix = prefix
                self._warming_up = False

    def _run_wave(self, wave: list[Request]) -> None:
        """Queue the wave's requests together (so one step admits them all) and wait until every slot is free."""
        with self._cond:
            if self._closed or self._stopping:
                raise RuntimeError("the scheduler was stopped during its warm-up")
            self._waiting.extend(wave)
            self._cond.notify_all()
        if self._thread is None:
            while self._has_work():
                try:
                    self.step()
                except Exception as exc:
                    self._fail_all(exc)
                    raise RuntimeError(f"the warm-up failed: {exc}") from exc
        else:
            with self._cond:  # the engine thread notifies after every step, and when stopped
                self._cond.wait_for(lambda: self._closed or not self._has_work())
        for req in wave:
            reason = req.handle.finish_reason
            if reason not in ("length", "stop"):
                cause = f": {req.handle.error}" if req.handle.error is not None else ""
                raise RuntimeError(f"a warm-up request ended with '{reason}'{cause}") from req.handle.error

    # ---- engine side (one thread) -------------------------------------------------------------
    def _has_work(self) -> bool:
        with self._cond:
            return bool(self._waiting) or any(r is not None for r in self._rows)

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
            with self._cond:
                self._cond.notify_all()  # a warm-up waits for the slots to be free

    def _fail_all(self, exc: Exception) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            self._prefilling = []
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
        while budget > 0:  # rounds of at most prefill_rows prompts, until the budget or the free slots run out
            plan = self._plan_prefill(budget)
            if not plan:
                break
            budget -= sum(chunk for _, chunk in plan)
            self._prefill(plan)
            if self._prefilling:  # the budget cut a prompt: it goes on next step
                break
        if any(row is not None and not row.done for row in self._decoding()):
            self._decode()
        self._free_finished()

    def _drop_aborted(self) -> None:
        with self._cond:
            self._prefilling = [req for req in self._prefilling if not req.aborted]
            for b, req in enumerate(self._rows):
                if req is not None and req.aborted:
                    self._release(b)

    def _plan_prefill(self, budget: int) -> list[tuple[Request, int]]:
        """A round of prompt chunks, (request, tokens), within `budget` tokens: first the request whose
        prefill goes on from the last step (on staging row 0), then newly admitted ones (next rows). Only
        the last can stay unfinished, so at most one carries over."""
        rows = self.limits.prefill_rows
        # Rows are right-padded to the widest chunk, and every row's padded width must fit in the cache.
        seq = self.limits.max_seq_len
        room, widest = seq, 0
        plan: list[tuple[Request, int]] = []
        for going_on in self._prefilling:
            chunk = min(budget, int(going_on.row.prompt.numel()) - going_on.prefilled)
            plan.append((going_on, chunk))
            budget -= chunk
            room, widest = seq - going_on.prefilled, chunk
        while budget > 0 and len(plan) < rows:
            req = self._admit(stage_row=len(plan))
            if req is None:
                break
            if req.prefilled + widest > seq:  # its pool prefix leaves no room for this step's width
                self._admit_later(req)
                break
            self._count_prefix_hit(req)
            left = int(req.row.prompt.numel()) - req.prefilled
            chunk = left if self.prefill.staging is None else min(budget, left, room)  # no cache: the whole prompt
            plan.append((req, chunk))
            budget -= chunk
            room, widest = min(room, seq - req.prefilled), max(widest, chunk)
            if chunk < left:
                break
        return plan

    def _admit(self, stage_row: int) -> Request | None:
        """The next waiting request that needs a prefill, if a slot is free: it is given the slot and
        staging row `stage_row` (returned). Requests that need none (done at once, exact prefix-pool hits)
        are placed on the way."""
        while True:
            with self._cond:
                if not self._waiting or None not in self._rows:
                    return None
                req = self._waiting.popleft()
                req.slot = self._rows.index(None)
                self._rows[req.slot] = req  # reserved: the slot's row is written when the prefill ends
            begin(req.row)
            if req.row.done:  # max_tokens 0, a grammar that accepts nothing: freed at the end of the step
                continue
            req.stage_row = stage_row
            try:
                exact = self._start_from_pool(req)
            except Exception as exc:  # this request fails; the others go on
                self._fail(req, exc)
                continue
            if exact is None:
                self._prefilling.append(req)
                return req
            self._first_tokens([(req, exact)])

    def _admit_later(self, req: Request) -> None:
        """Undo `_admit`: the request waits at the head of the queue again."""
        with self._cond:
            self._prefilling.remove(req)
            self._rows[req.slot] = None
            req.slot, req.stage_row, req.prefilled = -1, -1, 0
            self._waiting.appendleft(req)

    def _count_prefix_hit(self, req: Request) -> None:
        reused = req.handle.stats.prefix_hit_tokens
        if reused:
            with self._cond:
                self._counts["prefix_hit_requests"] += 1
                self._counts["prefix_hit_tokens"] += reused

    def _start_from_pool(self, req: Request) -> torch.Tensor | None:
        """Start the request's staging row from the longest prefix the pool holds. An exact hit is copied
        straight into the slot and its stored logits returned: no prefill at all."""
        hooks = self.prefix
        req.handle.stats.prefix_hit_tokens = 0
        self.prefill.clear_row(req.stage_row)
        if hooks is None or self.prefill.staging is None:
            return None
        row = req.row
        match = hooks.longest_prefix(row)
        if match is None:
            return None
        entry: PoolEntry = match.item
        kv = entry.kv()
        assert kv is not None
        req.handle.stats.prefix_hit_tokens = match.reuse
        if match.exact:
            self._count_prefix_hit(req)
            self._place(req, kv, len(entry.tokens))
            return entry.last_logits()
        self.prefill.start_from(kv, len(entry.tokens), row.loops, match.reuse, req.stage_row)
        req.prefilled = match.reuse
        return None

    def _prefill(self, plan: list[tuple[Request, int]]) -> None:
        """Run the plan's chunks; requests whose prompt is then complete move to their slots and sample their
        first token, and a prompt the budget cut goes on from staging row 0 next step."""
        if not plan:
            return
        chunks = [req.row.prompt[req.prefilled : req.prefilled + chunk] for req, chunk in plan]
        try:
            logits, forwards = self.prefill.run(chunks, [req.row.loops for req, _ in plan])
        except Exception as exc:  # a failed step fails every request in it
            for req, _ in plan:
                self._fail(req, exc)
            self._prefilling = []
            return
        with self._cond:
            self._counts["prefill_steps"] += forwards
            self._counts["prefill_rows"] += len(plan)
        finished: list[tuple[Request, torch.Tensor]] = []
        for i, (req, chunk) in enumerate(plan):
            req.prefilled += chunk
            n = int(req.row.prompt.numel())
            if req.prefilled < n:
                continue
            self._prefilling.remove(req)
            if self.prefill.staging is not None:
                try:
                    kv = self.prefill.snapshot(n, req.row.loops, req.stage_row)
                    self._place(req, kv, n)
                except Exception as exc:
                    self._fail(req, exc)
                    continue
                if self.prefix is not None:
                    self.prefix.offer(req.row, kv, logits[i])
            finished.append((req, logits[i]))
        self._first_tokens(finished)
        if self._prefilling:  # at most one
            (req,) = self._prefilling
            self.prefill.move_to_first_row(req.prefilled, req.row.loops, req.stage_row)
            req.stage_row = 0

    def _first_tokens(self, finished: list[tuple[Request, torch.Tensor]]) -> None:
        """Sample the first token of requests whose prompt is in their slot now, from its logits [V]."""
        if not finished:
            return
        rows = [req.row for req, _ in finished]
        logits = torch.stack([lg for _, lg in finished])
        try:
            prepared = prepared_picks(rows, logits)
        except Exception:  # a row's own pick reports its error below
            prepared = {}
        for i, (req, _) in enumerate(finished):
            with self._cond:
                self._counts["prompt_tokens"] += int(req.row.prompt.numel())
            try:
                token = pick_token(req.row, logits[i], prepared.get(i))
            except Exception as exc:  # this request fails; the others go on
                self._fail(req, exc)
                continue
            if token is not None:
                self._emit(req, token)

    def _place(self, req: Request, kv: dict[str, torch.Tensor], length: int) -> None:
        """Copy a snapshot of the request's whole prompt (`length` tokens) into its slot."""
        if self.slots is not None:
            self.slots.restore(kv, length, req.row.loops, length, row=req.slot)
        req.prefilled = length

    def _decoding(self) -> list[Row | None]:
        """Each slot's row while it decodes (None: empty, reserved for a prefill, or aborted)."""
        return [None if r is None or r.aborted or r in self._prefilling else r.row for r in self._rows]

    def _decode(self) -> None:
        rows = self._decoding()
        live = [b for b, row in enumerate(rows) if row is not None and not row.done]
        loops = max(rows[b].loops for b in live)  # type: ignore[union-attr]
        n = step_rows(live[-1], len(rows))  # new requests take the lowest free slot
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
            self.decoded_buckets[n, loops] += 1
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
                if req is None or req in self._prefilling:
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
            empty_row(self.slots, b)  # an empty slot rides along at position 0
