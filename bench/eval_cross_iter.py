"""Held-out bits per byte of the built-in model with cross-iteration stochastic rounding, on CPU.

Compares float (fp16 training weights), plain INT4 (the shipped file), INT4 + 1-bit sign channel and
INT4 + 4-bit fraction channel at several loop counts; the stochastic variants over several seeds.
Writes OUT/cross_iter.json and OUT/cross_iter_bpb.png and prints a markdown table. Usage:

    PYTHONPATH=src python bench/eval_cross_iter.py [--windows 8] [--seq-len 256] [--loops 8,16,32] \
        [--seeds 0,1,2,3,4] [--out runs/cross_iter]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tinyloop.convert.add_channels import add_rounding_channels, load_float_checkpoint
from tinyloop.format.header import read_header
from tinyloop.runtime.loader import load_engine
from tinyloop.stochastic.weight import CrossIterRound
from tinyloop.train.evaluate import bpb_by_loops, engine_from_flat, eval_windows, read_val_docs

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "src" / "tinyloop" / "builtin" / "tiny.tinyloop"
DEFAULT_FLOAT = ROOT / ".carry" / "tiny_run1" / "weights_fp16.index.json"
CPU = torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--float-weights", type=Path, default=DEFAULT_FLOAT)
    p.add_argument("--corpus", type=Path, default=ROOT / ".carry" / "corpus")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "cross_iter")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--loops", default="8,16,32")
    p.add_argument("--seeds", default="0,1,2,3,4")
    args = p.parse_args(argv)
    loops = [int(x) for x in args.loops.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    val, _, _ = read_val_docs(args.corpus)
    wins = eval_windows(val, args.windows, args.seq_len)
    files = {}
    for bits, label in ((1, "sign"), (4, "frac4")):
        files[label] = args.out / f"tiny_{label}.tinyloop"
        add_rounding_channels(args.model, files[label], args.float_weights, bits, progress=False)
    runs: list[tuple[str, int | None]] = [("float", None), ("INT4", None)]
    runs += [(label, s) for label in ("INT4 + sign (1 bit)", "INT4 + frac4 (4 bits)") for s in seeds]
    raw: dict[str, list[dict[int, float]]] = {}
    for i, (label, seed) in enumerate(runs):
        if label == "float":
            engine = engine_from_flat(read_header(args.model).config, load_float_checkpoint(args.float_weights), CPU)
        elif label == "INT4":
            engine = load_engine(args.model, CPU, torch.float32)[1]
        else:
            path = files["sign" if "sign" in label else "frac4"]
            engine = load_engine(path, CPU, torch.float32, CrossIterRound(seed or 0, require_channels=True))[1]
        curve = bpb_by_loops(engine, wins, loops, batch=args.windows)
        raw.setdefault(label, []).append(curve)
        shown = ", ".join(f"L={n}: {v:.4f}" for n, v in curve.items())
        print(f"[{i + 1}/{len(runs)}] {label}" + (f" seed {seed}" if seed is not None else "") + f": {shown} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
    summary = {label: {n: _stats([c[n] for c in curves]) for n in loops} for label, curves in raw.items()}
    report = {
        "model": str(args.model),
        "windows": int(wins.shape[0]),
        "seq_len": args.seq_len,
        "loops": loops,
        "seeds": seeds,
        "runs": {label: [{str(n): v for n, v in c.items()} for c in curves] for label, curves in raw.items()},
        "summary": {label: {str(n): s for n, s in by_n.items()} for label, by_n in summary.items()},
        "time_s": time.monotonic() - t0,
    }
    (args.out / "cross_iter.json").write_text(json.dumps(report, indent=1) + "\n")
    subtitle = f"{int(wins.shape[0])} x {args.seq_len} B, {len(seeds)} seeds"
    _plot(summary, loops, args.out / "cross_iter_bpb.png", subtitle)
    print(_table(summary, loops))
    print(f"wrote {args.out / 'cross_iter.json'} and {args.out / 'cross_iter_bpb.png'} in {report['time_s']:.0f} s")
    return 0


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _table(summary: dict[str, dict[int, dict[str, float]]], loops: list[int]) -> str:
    lines = ["| weights | " + " | ".join(f"L = {n}" for n in loops) + " |", "|---" * (len(loops) + 1) + "|"]
    for label, by_n in summary.items():
        cells = []
        for n in loops:
            s = by_n[n]
            cells.append(f"{s['mean']:.4f}" if s["n"] == 1 else f"{s['mean']:.4f} ± {s['std']:.4f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(summary: dict[str, dict[int, dict[str, float]]], loops: list[int], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, by_n in summary.items():
        means = [by_n[n]["mean"] for n in loops]
        errs = [by_n[n]["std"] for n in loops]
        ax.errorbar(loops, means, yerr=errs, marker="o", capsize=4, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(loops, [str(n) for n in loops])
    ax.set_xlabel("loops L")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title(f"tiny: cross-iteration rounding ({subtitle}; bars: ±1 std)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
