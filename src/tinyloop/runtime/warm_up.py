"""Warm-up: requests run through a scheduler before any traffic, so that what a GPU does on first use
(compile Triton kernels, capture a CUDA graph per decode batch size) is not paid by the first requests; a
decode step of every batch size must have run at every depth asked, and the scheduler keeps no trace of them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tinyloop.runtime.requests import Request
from tinyloop.runtime.scheduler import SlotScheduler, step_rows


@dataclass(frozen=True)
class WarmUpReport:
    """What a warm-up ran: its seconds, the decode batch sizes (`decode_buckets`) it stepped at each of
    `loops`, and its requests."""

    seconds: float
    buckets: tuple[int, ...]
    loops: tuple[int, ...]
    requests: int


def decode_buckets(max_batch: int) -> list[int]:
    """Every batch size a decode step of max_batch slots can run, largest first."""
    return sorted({step_rows(last, max_batch) for last in range(max_batch)}, reverse=True)


def warm_up(scheduler: SlotScheduler, waves: list[list[Request]], loops: tuple[int, ...]) -> WarmUpReport:
    """Run `waves` one after another, each queued at once and finished before the next (on the engine thread
    if started, else by stepping here), leaving no trace; RuntimeError unless a decode step of every bucket
    ran at each of `loops`."""
    began = time.perf_counter()
    decoded_before = dict(scheduler.decoded_buckets)
    with scheduler._untraced():
        for wave in waves:
            scheduler._run_wave(wave)
    buckets = decode_buckets(scheduler.limits.max_batch)
    for depth in loops:
        missing = [rows for rows in buckets
                   if scheduler.decoded_buckets[rows, depth] == decoded_before.get((rows, depth), 0)]  # fmt: skip
        if missing:
            raise RuntimeError(f"the warm-up ran no decode step over {missing} slots at {depth} loops")
    return WarmUpReport(time.perf_counter() - began, tuple(buckets), loops, sum(len(w) for w in waves))
