"""The fastest a decode step (and a short prefill) can be when every dependent phase waits for the one before
it: weight bytes at the measured copy bandwidth plus one measured phase boundary per phase, for a preset at a
loop count.

    python bench/phase_floor.py                       # seed-407m at 8 loops and Ouro-1.4B's shape at 4 loops
    python bench/phase_floor.py --preset seed-407m --loops 8 --bandwidth 4.07 --boundary-us 0.99
    python bench/phase_floor.py --results bench/results/h200_headline_seed407m_ouro.json --plot docs/gpu_phase_floor.png

Phases counted per layer application, the fewest a one-token step of these models can have while each phase
reads the whole output of the one before: QKV (norm fused), attention (RoPE and cache write fused), output
projection (+ residual), gate / up (norm and SwiGLU fused), down projection (+ residual); per token two more,
the embedding row and the head (final norm fused). Sandwich norms, loop-input adds and exit gates are assumed
fused into a neighbour (they are separate launches today), so the phase count favours the target.

Defaults are measured on the H200 (bench/results): copy bandwidth 4.07 TB/s
(h200_prefill_profiles_l2_residency.json, 2 GiB device-to-device copy, bytes read + written), a phase boundary
0.99 us (h200_grid_barrier.json: one
program per SM writes a value, the next kernel in a CUDA graph under programmatic dependent launch reads
another program's value; a grid barrier inside one persistent kernel cost 1.92 us). Weights: INT4 with one
16-bit scale and one 16-bit minimum per group of 64 (0.5625 bytes per weight), the embedding row and the head
likewise; the KV cache is read in 16 bits at the step's position.

Prefill (`--prefill-tokens`, seed-407m only by default): the current design dequantizes each physical layer's
INT4 matrices to 16 bits once (read the codes, write the copy) and multiplies with cuBLAS, which reads the
16-bit copy once per layer application; nine launches per layer application (two norms, four GEMMs, RoPE and
cache write, attention, SwiGLU) plus one dequantization per matrix, each a boundary. The alternative, a GEMM
on the INT4 codes, reads 4x fewer bytes but is bound by the matrix units (`--tflops`, 790 measured on the
H200 for bf16, the device notes' figure); neither count includes the attention or elementwise kernels' own time.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyloop.config import ArchConfig
from tinyloop.presets import preset

BYTES_PER_INT4_WEIGHT = 0.5 + 2 * 2 / 64  # codes + scale + minimum per group of 64
PHASES_PER_LAYER = 5
PHASES_PER_TOKEN = 2  # embedding row, head
# The decode targets, ms for 128 tokens after a 128-token prompt.
TARGET_MS = {"seed-407m": 60.0, "ouro-1.4b-shape": 128 / 1000 * 1e3}
# gpu_suite result sections holding each preset's measured decode.
RESULT_SECTION = {"seed-407m": "seed407m", "ouro-1.4b-shape": "ouro"}
PREFILL_LAUNCHES_PER_LAYER = 9
MATRICES_PER_LAYER = 4


@dataclass(frozen=True)
class StepFloor:
    weight_bytes: float  # one token's weight reads (body once per loop)
    kv_bytes: float  # one token's KV-cache reads at the step's position
    phases: int  # dependent phases in one step

    def bytes_us(self, bandwidth_tbps: float) -> float:
        return (self.weight_bytes + self.kv_bytes) / (bandwidth_tbps * 1e6)

    def chain_us(self, bandwidth_tbps: float, boundary_us: float) -> float:
        return self.bytes_us(bandwidth_tbps) + self.phases * boundary_us


def layer_weights(cfg: ArchConfig) -> int:
    ffn_in = 2 * cfg.ffn_dim if cfg.ffn_kind == "swiglu" else cfg.ffn_dim
    qkv, out = cfg.d_model * (cfg.q_dim + 2 * cfg.kv_dim), cfg.q_dim * cfg.d_model
    return qkv + out + cfg.d_model * ffn_in + cfg.ffn_dim * cfg.d_model


def step_floor(cfg: ArchConfig, loops: int, position: int) -> StepFloor:
    applications = cfg.n_cache_slots(loops)  # one KV slot per layer application
    weights = applications * layer_weights(cfg) + (cfg.vocab_size + 1) * cfg.d_model  # head + embedding row
    kv = applications * position * 2 * cfg.kv_dim * 2
    return StepFloor(weights * BYTES_PER_INT4_WEIGHT, kv, applications * PHASES_PER_LAYER + PHASES_PER_TOKEN)


def prefill_floor_ms(
    cfg: ArchConfig, loops: int, tokens: int, bandwidth_tbps: float, boundary_us: float, tflops: float
) -> dict[str, float]:
    """Floors of a `tokens`-row prefill: dequantize + 16-bit GEMMs, and GEMMs on the INT4 codes (ms)."""
    applications = cfg.n_cache_slots(loops)  # one KV slot per layer application
    weights = layer_weights(cfg)
    bw = bandwidth_tbps * 1e9  # bytes per ms
    gemm_16bit = applications * weights * 2 / bw
    dequantize = cfg.n_layers * weights * (BYTES_PER_INT4_WEIGHT + 2) / bw
    compute = 2 * tokens * applications * weights / (tflops * 1e9)
    return {
        "16-bit GEMMs at copy bandwidth": max(gemm_16bit, compute),
        "dequantization": dequantize,
        "dequantization launch boundaries": cfg.n_layers * MATRICES_PER_LAYER * boundary_us / 1e3,
        "layer launch boundaries": applications * PREFILL_LAUNCHES_PER_LAYER * boundary_us / 1e3,
        "INT4 GEMMs at the matrix units' rate": max(applications * weights * BYTES_PER_INT4_WEIGHT / bw, compute),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", help="default: seed-407m and ouro-1.4b-shape")
    ap.add_argument("--loops", type=int, action="append", help="one per --preset (default: the preset's)")
    ap.add_argument("--bandwidth", type=float, default=4.07, help="copy bandwidth, TB/s")
    ap.add_argument("--boundary-us", type=float, default=0.99, help="one dependent phase boundary, us")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before the decoded ones")
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens")
    ap.add_argument("--prefill-tokens", type=int, default=128, help="prefill rows (seed-407m's table)")
    ap.add_argument("--tflops", type=float, default=790.0, help="bf16 matrix rate, TFLOP/s")
    ap.add_argument("--results", help="a bench/gpu_suite.py JSON whose measured decode goes beside the floors")
    ap.add_argument("--plot", help="PNG: floors, target and measured decode time per model")
    args = ap.parse_args()
    names = args.preset or ["seed-407m", "ouro-1.4b-shape"]
    loops = args.loops or [preset(n).default_loops for n in names]
    if len(loops) != len(names):
        ap.error(f"give one --loops per --preset ({len(names)} presets, {len(loops)} loop counts)")
    print(f"copy bandwidth {args.bandwidth} TB/s, phase boundary {args.boundary_us} us")
    measured = _measured_ms(Path(args.results)) if args.results else {}
    print("| model | loops | phases per token | weight MB per token | bytes only | + one boundary per phase |")
    print("|---|---|---|---|---|---|")
    rows: list[tuple[str, float, float]] = []
    for name, n_loops in zip(names, loops, strict=True):
        cfg = preset(name)
        steps = [step_floor(cfg, n_loops, args.prompt + i) for i in range(args.tokens)]
        bytes_ms = sum(s.bytes_us(args.bandwidth) for s in steps) / 1e3
        chain_ms = sum(s.chain_us(args.bandwidth, args.boundary_us) for s in steps) / 1e3
        per_token = args.tokens / chain_ms * 1e3
        print(
            f"| {name} | {n_loops} | {steps[0].phases} | {steps[0].weight_bytes / 1e6:.0f} "
            f"| {bytes_ms:.1f} ms ({args.tokens / bytes_ms * 1e3:,.0f} tok/s) "
            f"| {chain_ms:.1f} ms ({per_token:,.0f} tok/s) |"
        )
        rows.append((name, bytes_ms, chain_ms))
    if args.plot:
        _plot(rows, measured, args.tokens, args.plot)
    cfg, n_loops = preset(names[0]), loops[0]
    parts = prefill_floor_ms(cfg, n_loops, args.prefill_tokens, args.bandwidth, args.boundary_us, args.tflops)
    print(f"\nprefill of {args.prefill_tokens} tokens, {cfg.name} at {n_loops} loops (ms):")
    for label, ms in parts.items():
        print(f"  {label:40s} {ms:6.2f}")
    dense = sum(v for k, v in parts.items() if not k.startswith("INT4"))
    direct = parts["INT4 GEMMs at the matrix units' rate"] + parts["layer launch boundaries"]
    print(f"  {'dequantize + 16-bit GEMMs, launches':40s} {dense:6.2f}")
    print(f"  {'INT4 GEMMs, launches (no dequantization)':40s} {direct:6.2f}")


def _measured_ms(path: Path) -> dict[str, float]:
    data: dict[str, Any] = json.loads(path.read_text())
    found = {name: data[s]["int4"] for name, s in RESULT_SECTION.items() if "int4" in data.get(s, {})}
    headline = data.get("headline") or {}  # gpu_suite's headline section: {"seed407m": {...}, "ouro": {...}}
    found.update({name: headline[s] for name, s in RESULT_SECTION.items() if s in headline})
    return {name: row["decode_128_tokens_ms"] for name, row in found.items()}


def _plot(rows: list[tuple[str, float, float]], measured: dict[str, float], tokens: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.6), squeeze=False)
    for ax, (name, bytes_ms, chain_ms) in zip(axes[0], rows, strict=True):
        bars = {"weight bytes at\ncopy bandwidth": bytes_ms, "+ one boundary\nper phase": chain_ms}
        if name in TARGET_MS:
            bars["target"] = TARGET_MS[name]
        if name in measured:
            bars["TinyLoop\nmeasured"] = measured[name]
        colors = ["#9ecae1", "#3182bd", "#e6550d", "#636363"][: len(bars)]
        ax.bar(list(bars), list(bars.values()), color=colors)
        for i, v in enumerate(bars.values()):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_title(f"{name}: decode {tokens} tokens")
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
