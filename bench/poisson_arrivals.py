"""Continuous batching under Poisson arrivals: tinyloop.Scheduler against static batches (generate_batch).

N requests arrive as a Poisson process (mean `--rate` per second) with prompts and outputs of uniformly
drawn lengths; the Scheduler admits each as it comes. The static baseline runs the same requests, in
arrival order, as back-to-back `generate_batch` calls of B rows, B = the Scheduler's mean decode batch
(all requests present at the start: no waiting for arrivals). Reported: generated tokens/s of each, their
ratio, and TTFT p50/p99 (Scheduler: from submission; static: from the start of the run). Throughput is
also given per second of this process's CPU time, which other jobs on a shared machine do not inflate.

--warm-up first runs both over the same requests untimed, so that neither pays for compiling kernels or capturing
graphs (on a fresh H100 the Scheduler's timed run, which goes first, took 9 s more wall clock than CPU time).

    PYTHONPATH=src python bench/poisson_arrivals.py --warm-up                # GPU defaults: 256 requests
    PYTHONPATH=src python bench/poisson_arrivals.py --requests 48 --prompt 32 128 --output 16 64 --rate 4 --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time

import numpy as np
import torch

import tinyloop


def _requests(args: argparse.Namespace) -> tuple[list[list[int]], list[int], np.ndarray]:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.prompt[0], args.prompt[1] + 1, args.requests)
    prompts = [rng.integers(32, 127, n).tolist() for n in lengths]
    outputs = rng.integers(args.output[0], args.output[1] + 1, args.requests).tolist()
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.requests))
    return prompts, outputs, arrivals - arrivals[0]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run_scheduler(model: tinyloop.Model, prompts, outputs, arrivals, args) -> dict:
    scheduler = tinyloop.Scheduler(
        model, max_batch=args.max_batch, prefill_chunk_tokens=args.chunk, prefill_rows=args.prefill_rows
    )
    handles: list[tinyloop.RequestHandle] = []
    c0, t0 = time.process_time(), time.perf_counter()
    with scheduler:

        def arrive() -> None:
            for i, (prompt, n) in enumerate(zip(prompts, outputs, strict=True)):
                delay = arrivals[i] - (time.perf_counter() - t0)
                if delay > 0:
                    time.sleep(delay)
                handles.append(scheduler.submit(prompt, max_tokens=n, temperature=0.8, seed=i))

        feeder = threading.Thread(target=arrive)
        feeder.start()
        feeder.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = scheduler.stats()
    tokens = sum(h.result().size for h in handles)
    ttft = [h.stats.ttft_s for h in handles if h.stats.ttft_s is not None]
    return {
        "wall_s": wall, "cpu_s": cpu, "generated_tokens": tokens, "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu, "mean_batch": stats["decode_rows"] / max(stats["decode_steps"], 1),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "latency_p50_s": _pct([h.stats.latency_s for h in handles], 50), "stats": stats,
    }  # fmt: skip


def run_static(model: tinyloop.Model, prompts, outputs, batch: int) -> dict:
    ttft: list[float] = []
    tokens = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for lo in range(0, len(prompts), batch):
        rows = range(lo, min(lo + batch, len(prompts)))
        first: set[int] = set()
        stream = model.generate_batch_stream(
            [prompts[i] for i in rows], max_tokens=[outputs[i] for i in rows], temperature=0.8, seed=list(rows)
        )
        for row, _ in stream:
            tokens += 1
            if row not in first:
                first.add(row)
                ttft.append(time.perf_counter() - t0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "generated_tokens": tokens, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu, "batch": batch,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--rate", type=float, default=16.0, help="mean arrivals per second")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--chunk", type=int, help="prefill_chunk_tokens (default: the Scheduler's)")
    p.add_argument("--prefill-rows", type=int, default=4, help="prefill_rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's); on a shared CPU give 1")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--warm-up", action="store_true", help="run both once over the same requests, untimed, first")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = tinyloop.Model(args.model, max_seq_len=args.prompt[1] + args.output[1])
    prompts, outputs, arrivals = _requests(args)
    if args.warm_up:
        warm = run_scheduler(model, prompts, outputs, arrivals, args)
        run_static(model, prompts, outputs, max(1, round(warm["mean_batch"])))
    sched = run_scheduler(model, prompts, outputs, arrivals, args)
    static = run_static(model, prompts, outputs, max(1, round(sched["mean_batch"])))
    result = {
        "model": args.model, "device": str(model.device), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "args": vars(args), "warmed_up": args.warm_up,
        "scheduler": sched, "static": static, "throughput_ratio": sched["tokens_per_s"] / static["tokens_per_s"],
        "cpu_throughput_ratio": sched["tokens_per_cpu_s"] / static["tokens_per_cpu_s"],
    }  # fmt: skip
    print("| | tokens/s | tokens per CPU-s | TTFT p50 | TTFT p99 | mean batch |\n|---|---|---|---|---|---|")
    print(
        f"| Scheduler (max_batch {args.max_batch}) | {sched['tokens_per_s']:.1f} | {sched['tokens_per_cpu_s']:.1f} | "
        f"{sched['ttft_p50_s']:.2f} s "
        f"| {sched['ttft_p99_s']:.2f} s | {sched['mean_batch']:.2f} |"
    )
    print(
        f"| static generate_batch (B={static['batch']}) | {static['tokens_per_s']:.1f} | "
        f"{static['tokens_per_cpu_s']:.1f} | "
        f"{static['ttft_p50_s']:.2f} s | {static['ttft_p99_s']:.2f} s | {static['batch']} |"
    )
    print(f"throughput ratio (Scheduler / static): {result['throughput_ratio']:.2f} wall clock, "
          f"{result['cpu_throughput_ratio']:.2f} per CPU-second")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
