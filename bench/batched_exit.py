"""Per-row adaptive depth in batched decode steps: each row's iterations per token, and the iterations the
batched steps ran (a step lasts until its deepest row is done), at several batch sizes.

    PYTHONPATH=src python bench/batched_exit.py --batches 1 8 32 --tokens 16 --criterion kl
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import tinyloop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--loops", type=int, default=8)
    p.add_argument("--criterion", default="kl")
    p.add_argument("--tol", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = tinyloop.Model(args.model, max_seq_len=256)
    rng = np.random.default_rng(args.seed)
    rows = []
    print(
        "| batch | iterations per token (rows' mean) | saved per row | iterations per batched step | saved per step |"
    )
    print("|---|---|---|---|---|")
    for batch in args.batches:
        prompts = [rng.integers(32, 127, int(rng.integers(16, 64))).tolist() for _ in range(batch)]
        with tinyloop.Scheduler(model, max_batch=batch, max_loops=args.loops) as s:
            handles = [
                s.submit(q, max_tokens=args.tokens, loops=args.loops, temperature=0.0,
                         exit_criterion=args.criterion, exit_tol=args.tol)
                for q in prompts
            ]  # fmt: skip
        stats = s.stats()
        # Decode-step tokens only (the first token comes from the prefill, always at full depth).
        depths = [d for h in handles for d in h.stats.token_loops[1:]]
        per_row = float(np.mean(depths))
        per_step = stats["decode_iterations"] / stats["decode_steps"]
        rows.append({"batch": batch, "row_iterations": per_row, "step_iterations": per_step,
                     "steps": stats["decode_steps"], "tokens": len(depths)})  # fmt: skip
        print(f"| {batch} | {per_row:.2f} | {1 - per_row / args.loops:.0%} | {per_step:.2f} | "
              f"{1 - per_step / args.loops:.0%} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
