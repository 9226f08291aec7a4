"""Markdown tables and the decode-vs-loops plot for docs/BENCHMARKS.md from bench/gpu_suite.py's JSON.

python bench/render_gpu_report.py bench/results/h200_suite_final.json [--plot docs/gpu_decode_vs_loops.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# Per-token weight bytes of seed-407m at 8 loops: prelude + coda + head once, the body 8 times.
SEED_TOKENS = 128


def floor_ms(res: dict[str, Any], loops: int, tokens: int) -> float:
    mib = 2**20
    per_token = (res["weights_mb"] - res["body_mb"] + loops * res["body_mb"]) * mib
    return 1e3 * tokens * per_token / (RESULTS_ENV["copy_bandwidth_TBps"] * 1e12)


RESULTS_ENV: dict[str, Any] = {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+", help="suite JSON files; later files override earlier sections")
    ap.add_argument("--plot")
    args = ap.parse_args()
    data: dict[str, Any] = {}
    for f in args.json:
        data.update({k: v for k, v in json.loads(Path(f).read_text()).items() if v})
    RESULTS_ENV.update(data.get("env", {"copy_bandwidth_TBps": 4.15}))
    seed = data["seed407m"]
    i4, f16 = seed["int4"], seed["fp16_body"]
    print(f"copy bandwidth {RESULTS_ENV['copy_bandwidth_TBps']:.2f} TB/s")
    print("| workload | floor | INT4 | fp16 body |")
    print("|---|---|---|---|")
    print(f"| decode 128 after 128 | {floor_ms(i4, 8, 128):.0f} ms | {i4['decode_128_tokens_ms']:.0f} ms "
          f"| {f16['decode_128_tokens_ms']:.0f} ms |")  # fmt: skip
    for n in (1024, 128):
        print(f"| prefill {n} | | {i4[f'prefill_{n}_ms']:.1f} ms | {f16[f'prefill_{n}_ms']:.1f} ms |")
    print(f"VRAM: INT4 {i4['vram_usage_mb']:.0f} MiB, fp16 body {f16['vram_usage_mb']:.0f} MiB")
    if "ouro" in data:
        o = data["ouro"]["int4"]
        print(f"Ouro-1.4B shape INT4: {o['decode_tokens_per_s']:.0f} tok/s, prefill 1024 {o['prefill_1024_ms']:.1f} ms")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("decode_tokens_per_s_by_loops", "seed-407m INT4 (bf16)"),
                           ("tiny_decode_tokens_per_s_by_loops", "built-in tiny (f32)")):  # fmt: skip
            curve = seed[key]
            loops = sorted(int(k) for k in curve)
            ax.plot(loops, [curve[str(k)] for k in loops], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("loops L")
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.set_title(f"TinyLoop decode on {data.get('env', {}).get('device', 'H200')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print("wrote", args.plot)


if __name__ == "__main__":
    main()
