"""A scheduled request and the handle its caller holds: tokens arrive from the engine thread, the caller
iterates or waits on them from its own thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tinyloop.runtime.decode import Row
from tinyloop.runtime.stats import TokenLogprob
from tinyloop.runtime.stop_strings import StopStringFilter

# GenerationStats.stop_reason -> the finish reason a handle reports.
FINISH_REASONS = {"max_tokens": "length", "stop_token": "stop", "stop_string": "stop", "grammar_end": "stop"}


@dataclass
class RequestStats:
    """prompt_tokens / generated_tokens: tokens in and out; ttft_s: submit to the first token the caller
    can read; latency_s: submit to the end; loops_per_token: mean iterations per generated token, whose
    iterations are in `token_loops` (a depth schedule or an exit criterion makes them differ);
    prefix_hit_tokens: prompt tokens served from the prefix pool instead of prefilled; logprobs: with
    submit(logprobs=k), each generated token's TokenLogprob, in order."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    loops_per_token: float = 0.0
    prefix_hit_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_loops: list[int] = field(default_factory=list)


class RequestHandle:
    """One submitted request. `tokens()` iterates its new token ids as they come (blocking) and `result()`
    returns them all (np.int32); both re-raise the request's error. finish_reason: None while it runs,
    then "stop" (stop token, stop string, grammar end), "length" (max_tokens), "abort" or "error"."""

    def __init__(self, prompt_tokens: int) -> None:
        self._cond = threading.Condition()
        self._tokens: list[int] = []
        self.submitted = time.perf_counter()
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.stats = RequestStats(prompt_tokens=prompt_tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def tokens(self) -> Iterator[int]:
        """Yield the new token ids as the engine produces them; ends when the request finishes."""
        i = 0
        while True:
            with self._cond:
                while i == len(self._tokens) and not self.done:
                    self._cond.wait()
                new, finished = self._tokens[i:], self.done
            i += len(new)
            yield from new
            if finished and i == len(self._tokens):
                if self.error is not None:
                    raise self.error
                return

    def result(self, timeout: float | None = None) -> np.ndarray:
        """All new token ids (np.int32) once the request has finished; TimeoutError after `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"the request did not finish within {timeout} s")
            if self.error is not None:
                raise self.error
            return np.asarray(self._tokens, dtype=np.int32)

    def _push(self, tokens: list[int]) -> None:
        with self._cond:
            if self.done or not tokens:
                return
            if self.stats.ttft_s is None:
                self.stats.ttft_s = time.perf_counter() - self.submitted
            self._tokens.extend(tokens)
            self.stats.generated_tokens = len(self._tokens)
            self._cond.notify_all()

    def _finish(self, reason: str, error: BaseException | None = None) -> bool:
        """Record the end (the first call wins); False if it had already finished."""
        with self._cond:
            if self.done:
                return False
            self.error = error
            self.stats.latency_s = time.perf_counter() - self.submitted
            self.finish_reason = reason
            self._cond.notify_all()
            return True

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"RequestHandle({self.stats.prompt_tokens} prompt tokens, {len(self._tokens)} generated, {state})"


@dataclass(eq=False)
class Request:
    """What the scheduler keeps for a request: its decode row, its stop-string filter, its handle, and
    where it is (slot: its cache row once admitted; stage_row: its row of the staging cache while its prompt
    is prefilled; prefilled: prompt tokens that row holds)."""

    row: Row
    handle: RequestHandle
    stop_filter: StopStringFilter | None = None
    slot: int = -1
    prefilled: int = 0
    stage_row: int = -1
    aborted: bool = False

    def emit(self, token: int) -> None:
        """Hand a new token to the caller, through the stop-string filter (which may end the row)."""
        flt = self.stop_filter
        if flt is None:
            self.handle._push([token])
            return
        released = flt.feed(token)
        if flt.matched:
            self.row.finish("stop_string")
        self.handle._push([t for t, _ in released])

    def complete(self) -> None:
        """The row finished: release what the filter holds and record the reason."""
        if self.stop_filter is not None and not self.stop_filter.matched:
            self.handle._push([t for t, _ in self.stop_filter.flush()])
        row = self.row
        # The first token comes from the prefill (full depth), each later one from a decode step.
        depths = ([row.loops] + row.step_depths)[: len(row.tokens)]
        if depths:
            self.handle.stats.token_loops = depths
            self.handle.stats.loops_per_token = sum(depths) / len(depths)
        self.handle._finish(FINISH_REASONS.get(row.stats.stop_reason, "stop"))
