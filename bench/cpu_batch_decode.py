"""Batched greedy decode on the CPU through the public API (Model.generate_batch_stream): aggregate
tokens/s of the built-in `tiny` at several batch sizes in one run, and (with --baseline-src) the B=1
generate_stream decode of another checkout's code, timed alternately with this one in the same run.

    python bench/cpu_batch_decode.py [--batches 1 2 4 8 16] [--repeat 5] [--threads 1] [--baseline-src /tmp/base/src]

Prompts: 64 seeded random printable bytes per row; 64 decode steps after the prefill (65 new tokens,
the first from the prefill), loops 8, temperature 0. Decode time runs from every row's first token to the
last token; tokens/s = batch x 64 / that time (median of --repeat runs, batch sizes interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import tinyloop

ROOT = Path(__file__).resolve().parents[1]


def prompts(batch: int, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(32, 127, length).astype(np.int32) for _ in range(batch)]


def time_batch(model: tinyloop.Model, rows: list[np.ndarray], steps: int, loops: int) -> tuple[float, float]:
    """(prefill s, decode s): until every row's first token, then until the last."""
    seen = 0
    t0 = time.perf_counter()
    t1 = t0
    for _ in model.generate_batch_stream(rows, steps + 1, loops, temperature=0.0):
        seen += 1
        if seen == len(rows):
            t1 = time.perf_counter()
    assert seen == len(rows) * (steps + 1), seen
    return t1 - t0, time.perf_counter() - t1


# Runs under another checkout's code too: only Model.generate_stream, which both have.
_B1_SNIPPET = """
import statistics, sys, time
import numpy as np
import tinyloop
steps, loops, n, repeat = (int(a) for a in sys.argv[1:5])
prompt = np.random.default_rng(0).integers(32, 127, n).astype(np.int32)
model = tinyloop.Model("tiny", max_seq_len=n + steps + 1, device="cpu")
list(model.generate_stream(prompt, 5, loops, temperature=0.0))
wall, cpu = [], []
for _ in range(repeat):
    t1 = c1 = None
    for i, _tok in enumerate(model.generate_stream(prompt, steps + 1, loops, temperature=0.0)):
        if i == 0:
            t1, c1 = time.perf_counter(), time.process_time()
    wall.append(time.perf_counter() - t1)
    cpu.append(time.process_time() - c1)
print(1e3 * statistics.median(wall), 1e3 * statistics.median(cpu))
"""


def b1_decode_ms(src: str, steps: int, loops: int, prompt_len: int, repeat: int = 3) -> tuple[float, float]:
    """Median (wall ms, process CPU ms) of `steps` greedy decode steps of Model.generate_stream (B=1) with
    the code under `src` (CPU time is the steadier measure on a machine other jobs load)."""
    cmd = [sys.executable, "-c", _B1_SNIPPET, str(steps), str(loops), str(prompt_len), str(repeat)]
    env = {**os.environ, "PYTHONPATH": src, "TINYLOOP_LOG_LEVEL": "0"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    wall, cpu = out.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline-src", default=None, help="src/ of another checkout to compare B=1 decode against")
    ap.add_argument("--baseline-pairs", type=int, default=5, help="alternating baseline/current B=1 runs")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = tinyloop.Model("tiny", max_seq_len=args.prompt_len + args.steps + 1, device="cpu")
    rows = {b: prompts(b, args.prompt_len) for b in args.batches}
    time_batch(model, rows[args.batches[0]], 4, args.loops)  # warm-up
    runs: dict[int, list[float]] = {b: [] for b in args.batches}
    for _ in range(args.repeat):
        for b in args.batches:
            runs[b].append(time_batch(model, rows[b], args.steps, args.loops)[1])
    model.close()
    result: dict[str, object] = {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
        "batches": {},
    }
    base = statistics.median(runs[args.batches[0]])
    base_tps = args.batches[0] * args.steps / base
    print(f"built-in tiny, loops {args.loops}, {args.prompt_len}-byte prompts, {args.steps} decode steps, "
          f"median of {args.repeat}; torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'vs first':>9}")
    for b in args.batches:
        med = statistics.median(runs[b])
        tps = b * args.steps / med
        result["batches"][str(b)] = {"ms_per_step": 1e3 * med / args.steps, "tokens_per_s": tps}  # type: ignore[index]
        print(f"{b:>5} {1e3 * med / args.steps:9.2f} {tps:10.1f} {tps / base_tps:8.2f}x")
    if args.baseline_src:
        here = str(ROOT / "src")
        pairs = []
        for _ in range(args.baseline_pairs):
            old_ms = b1_decode_ms(args.baseline_src, args.steps, args.loops, args.prompt_len)
            pairs.append((old_ms, b1_decode_ms(here, args.steps, args.loops, args.prompt_len)))
        summary = {}
        for i, kind in enumerate(("wall", "cpu")):
            old = statistics.median(p[0][i] for p in pairs)
            new = statistics.median(p[1][i] for p in pairs)
            summary[kind] = {"baseline_ms": old, "current_ms": new}
            change = 100 * (new / old - 1)
            print(f"B=1 generate_stream, {args.steps} decode steps, {kind} time (median of {args.baseline_pairs} "
                  f"alternating processes): baseline {old:.1f} ms, current {new:.1f} ms ({change:+.1f} %)")  # fmt: skip
        result["b1_generate_stream"] = {**summary, "pairs": pairs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
