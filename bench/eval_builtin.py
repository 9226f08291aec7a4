"""Evaluate a .tinyloop model (default: the built-in `tiny`) on the held-out stdlib corpus, on CPU.

Writes OUT/eval.json (bits per byte at loops 1-16, the function-header parse rate, sample generations)
and OUT/bpb_vs_loops.png. Usage:

    PYTHONPATH=src python bench/eval_builtin.py --corpus .carry/corpus --out runs/eval_builtin \
        [--model FILE.tinyloop] [--float-weights weights_fp16.index.json] [--windows 12]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tinyloop.train.evaluate import EVAL_LOOPS, evaluate_model_file

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "src" / "tinyloop" / "builtin" / "tiny.tinyloop"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--corpus", type=Path, default=ROOT / ".carry" / "corpus")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "eval_builtin")
    p.add_argument("--float-weights", type=Path, default=None, help="fp16 training weights, for the float curve")
    p.add_argument("--windows", type=int, default=16, help="validation windows (CPU time grows linearly)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--loops", default=",".join(map(str, EVAL_LOOPS)))
    p.add_argument("--headers", type=int, default=20)
    p.add_argument("--parse-loops", type=int, default=None, help="default: the model's default loop count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = evaluate_model_file(
        args.model, args.corpus, args.out, float_weights=args.float_weights, windows=args.windows,
        seq_len=args.seq_len, loops=[int(x) for x in args.loops.split(",")], headers=args.headers,
        parse_loops=args.parse_loops, seed=args.seed,
    )  # fmt: skip
    for label, curve in report["bpb"]["curves"].items():
        print(f"{label}: " + ", ".join(f"L={n}: {v:.3f}" for n, v in curve.items()))
    pr = report["parse_rate"]
    print(f"parse rate at loops {pr['loops']}: {pr['rate']:.2f} ({pr['headers']} headers)")
    json.dump(report["samples"], sys.stdout, indent=1)
    print(f"\nwrote {args.out / 'eval.json'} and {args.out / 'bpb_vs_loops.png'} in {report['time_s']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
