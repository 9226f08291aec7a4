"""The one place where the server talks to the engine: submit a request, read its tokens, abort it.

`ServeEngine` sends each request to `tinyloop.Scheduler` (continuous batching: requests share batched
decode steps and the prefix pool; an exit criterion stops each row's iterations inside the step). A request
with one of Ouro's exit rules (exit_threshold, exit_at_step, weighted_exit), which read the gate over all
loops, goes to `ExitRuleEngine` instead: one at a time, on its own thread, through
`Model.generate_tokens_stream`, because the scheduler does not apply those rules; the model's step lock
interleaves the two. Both hand back a `ServedRequest`: tokens as they come, the finish reason, the error,
and the statistics the server reports.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tinyloop.api.scheduler import Scheduler
from tinyloop.errors import QueueFullError
from tinyloop.runtime.requests import FINISH_REASONS, RequestHandle
from tinyloop.runtime.stats import TokenLogprob

# Request options that only the exit-rule path (Model.generate_tokens_stream) takes.
EXIT_OPTIONS = ("exit_threshold", "exit_at_step", "weighted_exit")
# Options that path cannot honour.
NOT_WITH_EXIT = ("stop", "grammar", "logprobs", "l_warmup_tokens")

__all__ = ["QueueFullError", "RequestStats", "ServeEngine", "ServedRequest"]


@dataclass
class RequestStats:
    """What one request reports: tokens in and out, mean loops per generated token, tokens that stopped
    iterating early, prompt tokens served by the prefix pool, (when asked) each token's logprobs, and the
    iterations each generated token ran."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    loops_per_token: float = 0.0
    early_exit_tokens: int = 0
    prefix_hit_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_loops: list[int] = field(default_factory=list)


class ServedRequest(Protocol):
    """A submitted request as the server sees it (either engine)."""

    @property
    def stats(self) -> RequestStats: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def done(self) -> bool: ...

    def tokens(self) -> Iterator[int]:
        """New token ids as they come (blocking); ends when the request finishes, fails or is aborted."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has finished (True) or `timeout` seconds passed (False)."""
        ...


class ScheduledRequest:
    def __init__(self, handle: RequestHandle, loops: int, exits: bool) -> None:
        self.handle = handle
        self._loops = loops
        self._exits = exits  # an exit criterion: tokens that ran fewer loops exited early

    @property
    def stats(self) -> RequestStats:
        s = self.handle.stats
        early = sum(1 for d in s.token_loops if d < self._loops) if self._exits else 0
        return RequestStats(s.prompt_tokens, s.generated_tokens, s.loops_per_token, early, s.prefix_hit_tokens,
                            s.logprobs, list(s.token_loops))  # fmt: skip

    @property
    def finish_reason(self) -> str | None:
        return self.handle.finish_reason

    @property
    def error(self) -> BaseException | None:
        return self.handle.error

    @property
    def done(self) -> bool:
        return self.handle.done

    def tokens(self) -> Iterator[int]:
        try:
            yield from self.handle.tokens()
        except Exception:  # kept in .error, which the server reports
            return

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self.handle.result(timeout)
        except TimeoutError:
            return False
        except Exception:  # a failed request has finished too
            pass
        return True


class ExitRuleRequest:
    """A request of the exit-rule engine: its tokens go through a queue from the engine thread."""

    _END = object()

    def __init__(self, stream: Iterator[int], family_stats: Any, loops: int, prompt_tokens: int) -> None:
        self.stats = RequestStats(prompt_tokens=prompt_tokens)
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._stream = stream
        self._family_stats = family_stats
        self._loops = loops
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._aborted = threading.Event()
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def tokens(self) -> Iterator[int]:
        while True:
            item = self._queue.get()
            if item is ExitRuleRequest._END:
                self._queue.put(item)  # a second reader ends too
                return
            yield item

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def run(self) -> None:
        """Generate (on the engine thread) until the end, an abort or an error."""
        try:
            if not self._aborted.is_set():
                for token in self._stream:
                    self.stats.generated_tokens += 1
                    self._queue.put(token)
                    if self._aborted.is_set():
                        break
            if self._aborted.is_set():
                self.finish_reason = "abort"
            else:
                self.finish_reason = FINISH_REASONS.get(self._family_stats.stop_reason, "stop")
        except Exception as exc:  # the request fails, not the engine: the server reports it
            self.error = exc
            self.finish_reason = "error"
        finally:
            close = getattr(self._stream, "close", None)
            if close is not None:
                close()
            depths = list(getattr(self._family_stats, "exit_depths", []))[: self.stats.generated_tokens]
            if depths:
                self.stats.token_loops = depths
                self.stats.loops_per_token = sum(depths) / len(depths)
                self.stats.early_exit_tokens = sum(1 for d in depths if d < self._loops)
            self._done.set()
            self._queue.put(ExitRuleRequest._END)


class ExitRuleEngine:
    """Runs exit-rule requests one at a time, in submission order, on one thread (see the module docstring)."""

    def __init__(self, model: Any, max_queue: int) -> None:
        self.model = model
        self.max_queue = max_queue
        self._waiting: deque[ExitRuleRequest] = deque()
        self._running: ExitRuleRequest | None = None
        self._cond = threading.Condition()
        self._submit_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tinyloop-exit-rules", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._abort_all()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, prompt: Any, options: dict[str, Any]) -> ExitRuleRequest:
        clash = [name for name in NOT_WITH_EXIT if options.get(name)]
        if clash:
            used = ", ".join(n for n in EXIT_OPTIONS if options.get(n) not in (None, False))
            raise ValueError(f"{', '.join(clash)} cannot be combined with the exit options ({used})")
        kwargs = {k: v for k, v in options.items() if v is not None and k not in NOT_WITH_EXIT}
        kwargs.pop("l_warmup_loops", None)
        stop_tokens = kwargs.pop("stop_tokens", None)
        with self._submit_lock:  # last_family_stats is the latest call's: read it before another call
            stream = self.model.generate_tokens_stream(prompt, stop=bool(stop_tokens), **kwargs)
            family_stats = self.model.last_family_stats
        loops = options.get("loops") or self.model.config["default_loops"]
        request = ExitRuleRequest(stream, family_stats, loops, len(prompt))
        with self._cond:
            if self._stopping:
                raise QueueFullError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                stream.close()
                raise QueueFullError(f"the queue of exit-rule requests is full ({self.max_queue}); retry later")
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def abort(self, request: ExitRuleRequest) -> None:
        with self._cond:
            request._aborted.set()
            if request in self._waiting:
                self._waiting.remove(request)
                request.run()  # sees the abort: closes its stream and ends its tokens

    def counts(self) -> tuple[int, int]:
        """(running, waiting)"""
        with self._cond:
            return int(self._running is not None), len(self._waiting)

    def _abort_all(self) -> None:
        while self._waiting:
            req = self._waiting.popleft()
            req._aborted.set()
            req.run()
        if self._running is not None:
            self._running._aborted.set()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if not self._waiting:
                    return
                self._running = request = self._waiting.popleft()
            request.run()
            with self._cond:
                self._running = None


class ServeEngine:
    """The scheduler and the exit-rule engine behind one submit / abort / counts interface."""

    def __init__(self, model: Any, max_batch: int, max_queue: int, max_seq_len: int | None, max_loops: int | None):
        self.scheduler = Scheduler(model, max_batch, max_seq_len, max_queue, max_loops=max_loops)
        self.exit_rules = ExitRuleEngine(model, max_queue)
        self.max_seq_len = self.scheduler.limits.max_seq_len

    def start(self) -> None:
        self.scheduler.start()
        self.exit_rules.start()

    def stop(self, timeout: float) -> None:
        """Abort what is still running (the HTTP server has already let responses finish) and stop."""
        deadline = time.monotonic() + timeout
        self.exit_rules.stop(timeout)
        self.scheduler.stop(max(0.0, deadline - time.monotonic()), drain=False)

    def submit(self, prompt: Any, **options: Any) -> ServedRequest:
        """Queue a request. options: Model.generate's keyword arguments (logprobs included), or with any of
        EXIT_OPTIONS set, Model.generate_tokens_stream's. ValueError / TypeError: invalid options;
        QueueFullError: too many waiting."""
        if any(options.get(name) not in (None, False) for name in EXIT_OPTIONS):
            return self.exit_rules.submit(prompt, options)
        loops = options.get("loops") or self.scheduler.model.config["default_loops"]
        exits = options.get("exit_criterion") is not None
        return ScheduledRequest(self.scheduler.submit(prompt, **options), loops, exits)

    def abort(self, request: ServedRequest) -> None:
        """End the request and free its slot now."""
        if isinstance(request, ScheduledRequest):
            self.scheduler.abort(request.handle)
        elif isinstance(request, ExitRuleRequest):
            self.exit_rules.abort(request)

    def counts(self) -> dict[str, int]:
        """running and waiting requests (both engines) and the scheduler's totals."""
        stats = self.scheduler.stats()
        running, waiting = self.exit_rules.counts()
        return {**stats, "running": stats["running"] + running, "waiting": stats["waiting"] + waiting}
