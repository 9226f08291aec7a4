"""Where one decode step of several sequences goes, kernel by kernel, on one CUDA device: the step's launches in
order with their durations and what each adds to the step (its end minus the previous kernel's end), grouped by
kernel name (gpu_suite.step_timeline, the method of docs/BENCHMARKS.md "Where a decode step goes", at any row
count).

    PYTHONPATH=src python bench/step_timeline.py --model seed.tinyloop --rows 1 64 --out F.json [--loops 8] [--no-pdl]

Per row count it prints the kernels that add the most to the step, and writes the full timelines.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from gpu_suite import step_timeline, timeline_by_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--no-pdl", action="store_true", help="with TINYLOOP_DISABLE_PDL=1")
    args = ap.parse_args()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
                              "loops": args.loops, "pdl": not args.no_pdl, "rows": {}}  # fmt: skip
    for rows in args.rows:
        timeline = step_timeline(not args.no_pdl, args.model, args.loops, rows)
        timeline["by_kernel"] = timeline_by_kernel(timeline)
        result["rows"][rows] = timeline
        span = timeline["step_span_us"]
        print(f"{rows} rows: {timeline['kernels_per_step']} kernels, step {span:.1f} µs", flush=True)
        adds = sorted(timeline["by_kernel"].items(), key=lambda kv: -kv[1][0] * kv[1][2])
        for name, (launches, duration, added) in adds[:10]:
            total = launches * added
            print(f"    {name:40s} {launches:4d} x {added:6.2f} µs added = {total:7.1f} (runs {duration:.2f})")
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
