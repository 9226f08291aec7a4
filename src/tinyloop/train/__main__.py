"""Command line: `python -m tinyloop.train --data DIR --out DIR [--time-budget-s S | --steps N] ...`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tinyloop.train", description="Train the built-in byte-level looped model."
    )
    p.add_argument("--data", type=Path, required=True, help="corpus directory with train.bin and val.bin")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--config", default="tiny", help="tiny | test-tiny-train")
    p.add_argument("--steps", type=int, default=None, help="total steps (with --time-budget-s: an upper bound)")
    p.add_argument("--time-budget-s", type=float, default=None, help="wall-clock budget for train + eval + export")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=None, help="default 100, or 20 with --init-weights")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mean-loops", type=float, default=6.0)
    p.add_argument("--max-loops", type=int, default=16)
    p.add_argument("--grad-loops", type=int, default=4, help="backprop through the last k iterations")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--compile", action="store_true", help="torch.compile the loop iteration (CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", type=Path, default=None, help="ckpt.pt to continue from")
    p.add_argument("--init-weights", type=Path, default=None, help="weights_fp16 file, index or directory")
    p.add_argument("--eval-only", action="store_true", help="evaluate and export the --resume/--init-weights model")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--eval-loops", default="1,2,4,8,12,16")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--ckpt-every-s", type=float, default=120.0)
    p.add_argument("--stop-at", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines only)")
    p.add_argument("--no-export", action="store_true", help="skip the INT4 .tinyloop export")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    ns = parse_args(argv)
    from tinyloop.train.trainer import TrainArgs, run

    if ns.eval_only and ns.resume is None and ns.init_weights is None:
        raise SystemExit("--eval-only needs --resume or --init-weights")
    args = TrainArgs(
        data=ns.data, out=ns.out, config=ns.config, steps=ns.steps, time_budget_s=ns.time_budget_s,
        batch_size=ns.batch_size, seq_len=ns.seq_len, lr=ns.lr, min_lr_ratio=ns.min_lr_ratio,
        warmup_steps=ns.warmup_steps, weight_decay=ns.weight_decay, grad_clip=ns.grad_clip,
        mean_loops=ns.mean_loops, max_loops=ns.max_loops, grad_loops=ns.grad_loops, device=ns.device,
        compile=ns.compile, seed=ns.seed, resume=ns.resume, init_weights=ns.init_weights, eval_only=ns.eval_only,
        eval_windows=ns.eval_windows, eval_loops=[int(x) for x in ns.eval_loops.split(",")],
        log_every=ns.log_every, ckpt_every_s=ns.ckpt_every_s, stop_at=ns.stop_at, progress=not ns.no_progress,
        export=not ns.no_export,
    )  # fmt: skip
    run(args, start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
