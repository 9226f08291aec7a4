"""docs/gpu_batched_decode.png: aggregate decode tokens/s against batch size (bench/results/h100_batched_decode.json)
for seed-407m (this code and the base) and the Ouro-1.4B shape, with each model's weight-reading bound: every
step reads the INT4 weights once per layer application, so B rows cannot decode faster than B steps per
(weight bytes / memory bandwidth); and each row's bf16 K/V once per layer application, which the dotted bound adds
(at the benchmark's last position, 128 + 64).

    python bench/plot_batched_decode.py [--bandwidth-tb-s 3.35]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from tinyloop.presets import preset

ROOT = Path(__file__).resolve().parent.parent


def int4_bytes_per_step(name: str, loops: int) -> float:
    """INT4 bytes (4 bits per weight, a 16-bit scale and minimum per 64) one decode step reads."""
    cfg = preset(name)
    layer = cfg.d_model * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.d_model + 3 * cfg.d_model * cfg.ffn_dim
    per_weight = 0.5 + 4 / 64
    applications = cfg.n_prelude + cfg.n_coda + cfg.n_body * loops
    return per_weight * (layer * applications + cfg.vocab_size * cfg.d_model)


def kv_bytes_per_row(name: str, loops: int, positions: int) -> float:
    """bf16 K/V bytes one decode step reads per row at `positions` cached positions (one cache per layer
    application)."""
    cfg = preset(name)
    applications = cfg.n_prelude + cfg.n_coda + cfg.n_body * loops
    return applications * 2 * cfg.n_kv_heads * cfg.head_dim * 2 * positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth-tb-s", type=float, default=3.35, help="H100 SXM HBM3: 3.35")
    parser.add_argument("--positions", type=int, default=192, help="cached positions per row (128 + 64 new)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((ROOT / "bench/results/h100_batched_decode.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # Each series' runs merged in order, a later run's row counts replacing an earlier's: the Ouro shape's latest call
    # timed 1, 8 and 32 rows, its other row counts come from earlier calls.
    series = [((("pairs_hoist", "call2", "seed_new"),), "seed-407m, loops 8", "C0", "-"),
              ((("seed407m_base",),), "seed-407m, base 15d2b20", "C0", "-."),
              ((("ouro_shape_attention32",), ("pairs_hoist", "call2", "ouro_new")), "Ouro-1.4B shape, loops 4", "C1",
               "-")]  # fmt: skip
    for keys, label, color, style in series:
        rows = {batch: row for path in keys for batch, row in functools.reduce(dict.get, path, data)["rows"].items()}
        batches = sorted(int(b) for b in rows)
        tokens_per_s = [b * 1e3 / rows[str(b)]["step_ms"] for b in batches]
        ax.plot(batches, tokens_per_s, style, marker="o", color=color, label=label)
    batches = [1, 2, 4, 8, 16, 32, 64]
    for name, loops, color in (("seed-407m", 8, "C0"), ("ouro-1.4b-shape", 4, "C1")):
        step_s = int4_bytes_per_step(name, loops) / (args.bandwidth_tb_s * 1e12)
        ax.plot([1, 64], [1 / step_s, 64 / step_s], "--", color=color, alpha=0.5,
                label=f"{name} weight-reading bound ({step_s * 1e3:.2f} ms/step)")  # fmt: skip
        kv = kv_bytes_per_row(name, loops, args.positions)
        bound = [b * args.bandwidth_tb_s * 1e12 / (int4_bytes_per_step(name, loops) + b * kv) for b in batches]
        ax.plot(batches, bound, ":", color=color, alpha=0.5,
                label=f"{name} weights + K/V at {args.positions} positions")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (rows decoding together)")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title(f"Batched greedy decode, {data['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/gpu_batched_decode.png", dpi=110)


if __name__ == "__main__":
    main()
