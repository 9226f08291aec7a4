"""Time a depth sweep of the shipped python_snippets task three ways, and draw its accuracy-vs-loops plot:

1. `tinyloop eval`'s sweep: one backend per depth sharing one scorer (every depth from one forward, each
   question's context run once for its four choices);
2. the same backend run separately at each depth (what a harness does with one model per depth);
3. `Model.score` in a plain loop: one forward per (request, depth), log-softmax, sum, pick the best choice.

Run: OMP_NUM_THREADS=1 python bench/eval_sweep.py [--loops 1,2,4,8] [--out bench/results/eval_sweep_cpu.json]
     [--plot docs/eval_python_snippets.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

import tinyloop
from tinyloop.integrations.lm_eval import TASKS_DIR
from tinyloop.integrations.sweep import format_table, plot_sweep, run_sweep

TASK = "python_snippets"


def plain_loop(depths: list[int]) -> dict[int, float]:
    """acc per depth from Model.score, one request at a time (no batching, no sharing)."""
    docs = [json.loads(line) for line in (TASKS_DIR / TASK / f"{TASK}.jsonl").read_text().splitlines()]
    model = tinyloop.Model("tiny", dtype="float32")
    acc = {}
    for depth in depths:
        right = 0
        for doc in docs:
            scores = []
            text = doc["context"].rstrip()  # lm-eval moves the context's trailing whitespace to the choice
            for choice in doc["choices"]:
                context, tokens = model.encode(text), model.encode(doc["context"] + choice)
                logits = torch.from_numpy(model.score(tokens[:-1], loops=depth)).double()
                logp = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.from_numpy(tokens[1:]).long()]
                scores.append(float(logp[len(context) - 1 :].sum()))
            right += int(np.argmax(scores) == doc["answer"])
        acc[depth] = right / len(docs)
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loops", default="1,2,4,8")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default="bench/results/eval_sweep_cpu.json")
    p.add_argument("--plot", default="docs/eval_python_snippets.png")
    args = p.parse_args()
    depths = [int(d) for d in args.loops.split(",")]
    timings = {}
    load_before = os.getloadavg()

    start = time.perf_counter()
    swept = run_sweep("tiny", [TASK], depths, batch_size=args.batch_size, dtype="float32")
    timings["sweep (shared scorer)"] = time.perf_counter() - start

    start = time.perf_counter()
    separate = {}
    for depth in depths:
        alone = run_sweep("tiny", [TASK], [depth], batch_size=args.batch_size, dtype="float32")
        separate[depth] = alone.metrics[TASK][depth]
    timings["separate run per depth"] = time.perf_counter() - start

    start = time.perf_counter()
    plain = plain_loop(depths)
    timings["Model.score plain loop"] = time.perf_counter() - start

    for depth in depths:
        assert separate[depth] == swept.metrics[TASK][depth], (depth, separate[depth], swept.metrics[TASK][depth])
        assert abs(plain[depth] - swept.metrics[TASK][depth]["acc"]) < 1e-12, (depth, plain[depth])
    print(format_table(swept, TASK))
    for name, seconds in timings.items():
        print(f"{name}: {seconds:.1f} s")
    plot_sweep(swept, TASK, args.plot)
    record = {
        "task": TASK, "model": "tiny", "loops": depths, "batch_size": args.batch_size, "dtype": "float32",
        "metrics": {str(d): swept.metrics[TASK][d] for d in depths}, "seconds": timings,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
