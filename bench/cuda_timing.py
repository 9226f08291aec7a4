"""Timing helpers the GPU bench scripts share: wall-clock timings of synchronised calls, and the time per call of
a function captured many times in one CUDA graph (warmed up first on a side stream, which also compiles)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    """Seconds of each of `repeat` calls of fn, the device synchronised before and after each."""
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def graph_us(fn: Callable[[], Any], calls: int, repeat: int = 20) -> float:
    """Median µs per call of fn over `repeat` replays of one CUDA graph holding `calls` calls of it (timed by
    CUDA events around each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
