"""The one place where the server talks to the engine: submit a request, read its tokens, abort it.

`SerialEngine` serves queued requests one at a time on one engine thread through `Model.generate_stream`
(the family exit rules through `Model.generate_tokens_stream`): requests never share a batched step, so
a request waits for those queued before it. Handlers on other threads talk to it through a bounded queue
(`QueueFullError` when full) and each request's own token queue.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyloop.runtime.depth_schedule import DepthSchedule
from tinyloop.runtime.stats import TokenLogprob

# Request options that only the family exit path (Model.generate_tokens_stream) takes.
EXIT_OPTIONS = ("exit_threshold", "exit_at_step", "weighted_exit", "exit_criterion", "exit_tol", "min_loops")
# Options that path cannot honour.
NOT_WITH_EXIT = ("stop", "grammar", "logprobs", "l_warmup_tokens")
# engine stop reasons -> OpenAI finish_reason
FINISH_REASONS = {"max_tokens": "length", "stop_token": "stop", "stop_string": "stop", "grammar_end": "stop"}


class QueueFullError(RuntimeError):
    """The engine's queue of waiting requests is full (HTTP 503)."""


@dataclass
class RequestStats:
    """What one finished request reports (times in seconds since its submission)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    loops_per_token: float = 0.0
    early_exit_tokens: int = 0  # tokens that stopped iterating before the request's loops
    prefix_hit_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Request:
    """One submitted request: its tokens arrive on `tokens()` as the engine produces them."""

    _END = object()

    def __init__(self, prompt: np.ndarray, options: dict[str, Any], stream: Iterator[int], stats: Any) -> None:
        self.prompt = prompt
        self.options = options
        # The engine appends a token's logprob record before the token itself arrives here.
        self.stats = RequestStats(prompt_tokens=int(prompt.size), logprobs=getattr(stats, "logprobs", []))
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._stream = stream
        self._engine_stats = stats
        self._tokens: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._aborted = threading.Event()
        self._done = threading.Event()
        self._submitted = time.perf_counter()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def tokens(self) -> Iterator[int]:
        """New token ids as they come (blocking); ends when the request finishes, fails or is aborted."""
        while True:
            item = self._tokens.get()
            if item is Request._END:
                self._tokens.put(item)  # a second reader ends too
                return
            yield item

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has finished (True) or `timeout` seconds passed (False)."""
        return self._done.wait(timeout)

    def result(self) -> np.ndarray:
        out = np.fromiter(self.tokens(), dtype=np.int32)
        self._done.wait()
        return out

    def _run(self) -> None:
        """Generate on the engine thread until the end, an abort or an error."""
        try:
            if self._aborted.is_set():
                self.finish_reason = "abort"
                return
            for token in self._stream:
                if self.stats.generated_tokens == 0:
                    self.stats.ttft_s = time.perf_counter() - self._submitted
                self.stats.generated_tokens += 1
                self._tokens.put(token)
                if self._aborted.is_set():
                    self.finish_reason = "abort"
                    return
            self.finish_reason = FINISH_REASONS.get(self._engine_stats.stop_reason, "stop")
        except Exception as exc:  # the request fails, not the engine: the handler reports it
            self.error = exc
            self.finish_reason = "error"
        finally:
            close = getattr(self._stream, "close", None)
            if close is not None:
                close()  # an aborted stream gives its cache back now
            self._summarise()
            self.stats.latency_s = time.perf_counter() - self._submitted
            self._done.set()
            self._tokens.put(Request._END)

    def _summarise(self) -> None:
        stats, options = self._engine_stats, self.options
        loops = int(options["loops"])
        n = self.stats.generated_tokens
        depths = list(getattr(stats, "exit_depths", []))[:n]
        if not depths and n:
            # The first token comes from the prefill at full depth; decode step s runs the schedule's loops.
            schedule = DepthSchedule(options.get("l_warmup_tokens", 0), options.get("l_warmup_loops", 2))
            depths = [loops] + [schedule.loops_for(s, loops) for s in range(1, n)]
        if depths:
            self.stats.loops_per_token = sum(depths) / len(depths)
            self.stats.early_exit_tokens = sum(1 for d in depths if d < loops)


class SerialEngine:
    """Runs one request at a time, in submission order, on one engine thread (see the module docstring)."""

    def __init__(self, model: Any, max_queue: int = 256) -> None:
        self.model = model
        self.max_queue = max_queue
        self._waiting: deque[Request] = deque()
        self._running: Request | None = None
        self._cond = threading.Condition()
        self._submit_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.finished = 0
        self.aborted = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tinyloop-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0, drain: bool = True) -> None:
        """Stop taking requests; finish the queued ones (drain) within `timeout` seconds, then abort the rest."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stopping = True
            if not drain:
                self._abort_all()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                with self._cond:
                    self._abort_all()
                self._thread.join(5.0)

    def submit(self, prompt: np.ndarray, **options: Any) -> Request:
        """Queue a request (options: Model.generate's keyword arguments, or the exit options of
        Model.generate_tokens_stream). Invalid options raise ValueError / TypeError here."""
        exit_path = any(options.get(name) is not None for name in EXIT_OPTIONS)
        if exit_path:
            clash = [name for name in NOT_WITH_EXIT if options.get(name)]
            if clash:
                raise ValueError(f"{', '.join(clash)} cannot be combined with the exit options "
                                 f"({', '.join(n for n in EXIT_OPTIONS if options.get(n) is not None)})")  # fmt: skip
        with self._submit_lock:  # last_stats is the latest call's: read it before another call
            if exit_path:
                kwargs = {k: v for k, v in options.items() if v is not None and k not in NOT_WITH_EXIT}
                kwargs.pop("l_warmup_loops", None)
                kwargs.pop("stop_tokens", None)
                stream = self.model.generate_tokens_stream(prompt, stop=bool(options.get("stop_tokens")), **kwargs)
                stats = self.model.last_family_stats
            else:
                stream = self.model.generate_stream(prompt, **options)
                stats = self.model.last_stats
        loops = options.get("loops")
        options = dict(options, loops=self.model.config["default_loops"] if loops is None else loops)
        request = Request(prompt, options, stream, stats)
        with self._cond:
            if self._stopping:
                raise QueueFullError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                stream.close()
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def abort(self, request: Request) -> None:
        """End the request: a waiting one leaves the queue at once, a running one after its current token."""
        with self._cond:
            request._aborted.set()
            if request in self._waiting:
                self._waiting.remove(request)
                self._finish_unstarted(request)

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {
                "running": int(self._running is not None), "waiting": len(self._waiting),
                "finished": self.finished, "aborted": self.aborted,
            }  # fmt: skip

    def _finish_unstarted(self, request: Request) -> None:
        request._run()  # sees the abort: closes its stream and ends its tokens
        self.aborted += 1

    def _abort_all(self) -> None:
        while self._waiting:
            req = self._waiting.popleft()
            req._aborted.set()
            self._finish_unstarted(req)
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
            request._run()
            with self._cond:
                self._running = None
                if request.finish_reason == "abort":
                    self.aborted += 1
                else:
                    self.finished += 1


def make_engine(model: Any, max_batch: int, max_queue: int) -> SerialEngine:
    """The engine the server runs: today the serial engine (max_batch has no effect on it)."""
    return SerialEngine(model, max_queue=max_queue)
