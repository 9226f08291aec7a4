"""Markdown tables and plots for docs/BENCHMARKS.md from bench/gpu_suite.py's JSON: decode tokens/s vs loops
(`--plot`, from a seed407m section) and where one decode step's time goes (`--step-plot`, from a timeline section).

python bench/render_gpu_report.py bench/results/h200_seed407m_loops_speculative.json --plot docs/gpu_decode_vs_loops.png
python bench/render_gpu_report.py bench/results/h200_decode_step_timeline.json --step-plot docs/gpu_decode_step.png
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
    ap.add_argument("--step-plot")
    args = ap.parse_args()
    data: dict[str, Any] = {}
    for f in args.json:
        data.update({k: v for k, v in json.loads(Path(f).read_text()).items() if v})
    if args.step_plot:
        step_plot(step_timelines(data), args.step_plot)
        if "seed407m" not in data:
            return
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


# Kernel names of a decode step's timeline, grouped as the step plot shows them.
STEP_GROUPS = {
    "_gemv_int4_staged_kernel": "QKV + gate/up GEMVs (staged)",
    "_gemv_int4_staged_mma_kernel": "QKV + gate/up GEMVs (staged)",
    "_gemv_int4_gluon_kernel": "out + down + head GEMVs",
    "_rope_attention_kernel": "RoPE + attention",
}


def step_timelines(data: dict[str, Any]) -> dict[str, Any]:
    """The suite's timeline section ({"pdl", "no_pdl"}), or an older file's CUDA-core rows of the same data."""
    if "timeline" in data:
        return {"PDL (default)": data["timeline"]["pdl"], "no PDL": data["timeline"]["no_pdl"]}
    old = data["staged_mma_timeline"]
    return {"PDL (default)": old["cuda cores, pdl"], "no PDL": old["cuda cores, no pdl"]}


def step_plot(timelines: dict[str, Any], path: str) -> None:
    """One stacked bar per setting: µs each kernel group adds to a seed-407m decode step (launches x mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [*dict.fromkeys(STEP_GROUPS.values()), "other (loop adds, embedding, copies)"]
    settings = list(timelines)
    totals = {g: [0.0] * len(settings) for g in groups}
    for i, setting in enumerate(settings):
        for name, (launches, _duration, adds) in timelines[setting]["by_kernel"].items():
            totals[STEP_GROUPS.get(name, groups[-1])][i] += launches * adds
    fig, ax = plt.subplots(figsize=(8, 4.2))
    left = [0.0] * len(settings)
    for g in groups:
        ax.barh(settings, totals[g], left=left, label=g)
        left = [a + b for a, b in zip(left, totals[g], strict=True)]
    for i, total in enumerate(left):
        ax.text(total + 10, i, f"{total:.0f} µs", va="center")
    ax.set_xlabel("µs a decode step (seed-407m, loops 8, batch 1)")
    ax.set_xlim(0, max(left) * 1.15)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    ax.set_title("Where a decode step goes (H200; each kernel's end minus the previous one's)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
