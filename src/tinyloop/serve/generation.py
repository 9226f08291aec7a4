"""One request's choices on the engine, as events: text pieces while they come, then the end.

Tokens come from the engine thread's blocking iterator; each wait runs on a worker thread (its own
limiter, so waiting streams never starve the handlers of threads). A cancelled wait (the client went
away) aborts the request, which frees its engine slot at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from tinyloop.runtime.stats import TokenLogprob
from tinyloop.serve.engine import QueueFullError, RequestStats, ServedRequest
from tinyloop.serve.errors import APIError
from tinyloop.serve.metrics import ServerMetrics


@dataclass
class Piece:
    """New text of one choice and the tokens it came from (with their logprob records, if asked)."""

    index: int
    text: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class End:
    """A choice has finished."""

    index: int
    finish_reason: str
    stats: RequestStats


class ChoiceRunner:
    """Submits choices to the engine and turns their tokens into text (see the module docstring)."""

    def __init__(self, engine: Any, codec: Any, metrics: ServerMetrics, stop_ids: Sequence[int], threads: int) -> None:
        self.engine = engine
        self.codec = codec
        self.metrics = metrics
        self.stop_ids = frozenset(stop_ids)
        self.limiter = anyio.CapacityLimiter(threads)

    def submit(self, prompt: np.ndarray, options: dict[str, Any]) -> ServedRequest:
        try:
            return self.engine.submit(prompt, **options)
        except QueueFullError as exc:
            raise APIError(503, str(exc), code="queue_full") from None
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=_param_of(str(exc))) from None

    async def events(self, index: int, request: ServedRequest, arrival: float) -> AsyncIterator[Piece | End]:
        """Pieces of one choice, then its End; raises APIError if the engine failed the request."""
        decoder = self.codec.incremental()
        tokens = request.tokens()
        last = arrival
        n = 0
        try:
            while True:
                token = await anyio.to_thread.run_sync(next, tokens, None, abandon_on_cancel=True,
                                                       limiter=self.limiter)  # fmt: skip
                if token is None:
                    break
                now = time.perf_counter()
                (self.metrics.ttft if n == 0 else self.metrics.itl).observe(now - last)
                last = now
                records = request.stats.logprobs
                record = [records[n]] if n < len(records) else []
                n += 1
                text = "" if token in self.stop_ids else decoder.push(token)
                yield Piece(index, text, [token], record)
            rest = decoder.flush()
            if rest:
                yield Piece(index, rest)
            await anyio.to_thread.run_sync(request.wait, abandon_on_cancel=True, limiter=self.limiter)
        except BaseException:
            if not request.done:
                self.engine.abort(request)  # the client went away (or the handler failed): free the slot now
            self.metrics.finished(request.stats, "abort")
            raise
        reason = request.finish_reason or "abort"
        self.metrics.e2e.observe(time.perf_counter() - arrival)
        self.metrics.finished(request.stats, reason)
        if request.error is not None:
            err = request.error
            if isinstance(err, (ValueError, TypeError)):
                raise APIError(400, str(err))
            raise APIError(500, f"generation failed: {type(err).__name__}: {err}")
        yield End(index, reason, request.stats)

    async def merged(self, requests: Sequence[ServedRequest], arrival: float) -> AsyncIterator[Piece | End]:
        """The events of several choices as they come (one task per choice)."""
        if len(requests) == 1:
            async for event in self.events(0, requests[0], arrival):
                yield event
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        async def pump(i: int, request: ServedRequest) -> None:
            try:
                async for event in self.events(i, request, arrival):
                    await queue.put(event)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                await queue.put(exc)
            finally:
                await queue.put(done)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _param_of(message: str) -> str | None:
    """The request field an engine error names (its messages start with the argument's name)."""
    head = message.split(" ", 1)[0].strip(":")
    return head if head.isidentifier() else None
