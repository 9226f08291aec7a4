"""One-token attention (`cuda_ops.rope_attention`: RoPE, cache write and attention in one launch) for seed-407m's
heads (16 of 128, bfloat16) at 1-64 rows and 128-1,024 cached positions, per split count (and keys per block,
warps), against the default `KernelPolicy`'s choice: us per call inside a CUDA graph, the bandwidth achieved on
the keys and values it must read, and each result's max abs error against a float32 torch reference.

Each timed graph cycles through enough distinct cache copies that one pass reads `--stream-mb` MB or more (an
H100's L2 holds 50 MB), so keys and values come from DRAM; a variant that fails is recorded with its error and
the run goes on. Device (about a minute on an H100):

    PYTHONPATH=src python3 bench/attention_batched.py --out $OUT/attention_batched.json

The same on an older checkout's kernels and policy (one split count for every launch) for a baseline in the same
run: `PYTHONPATH=<older checkout>/src python3 bench/attention_batched.py --out $OUT/base.json`.

On the CPU, tiny sizes through Triton's interpreter, eager timings (a check of the script, not a measurement):

    TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/attention_batched.py --smoke --out /tmp/attention.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Any

import torch
import triton
from cuda_timing import graph_us

from tinyloop.kernels import cuda_ops
from tinyloop.kernels.one_token import OneTokenAttention
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.model.layers import apply_rope, rope_tables
from tinyloop.presets import preset

ROWS = (1, 2, 4, 8, 16, 32, 64)
POSITIONS = (128, 256, 1024)
SPLITS = (1, 2, 4, 8)
# Max abs error against the float32 reference: the kernel rounds the rotated query and the output to 16 bits.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


@dataclasses.dataclass(frozen=True)
class Shape:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    pairing: str
    dtype: torch.dtype


def parse_tile(text: str) -> tuple[int, int]:
    block, warps = (int(v) for v in text.lower().split("x"))
    return block, warps


def kv_bytes(rows: int, positions: int, shape: Shape) -> int:
    """Bytes of cached keys and values one call reads (positions 0..positions-1 of every row's kv heads)."""
    return 2 * rows * shape.n_kv_heads * positions * shape.head_dim * shape.dtype.itemsize


def reference(qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, shape: Shape) -> torch.Tensor:  # fmt: skip
    """float32: the rotated query over cached positions 0..pos-1 and the new key (rounded to the cache's dtype,
    as the cache stores it) and value; every row at the same position."""
    H, KVH, hd = shape.n_heads, shape.n_kv_heads, shape.head_dim
    rows, p = qkv.shape[0], int(pos[0])
    q, k_new, v_new = qkv.float().split((H * hd, KVH * hd, KVH * hd), dim=-1)
    c, s = cos[pos][:, None], sin[pos][:, None]
    q = apply_rope(q.view(rows, 1, H, hd), c, s, shape.pairing)[:, 0]  # [rows, H, hd]
    k_new = apply_rope(k_new.view(rows, 1, KVH, hd), c, s, shape.pairing)[:, 0].to(k.dtype)
    keys = torch.cat((k[:, :, :p].float(), k_new.float()[:, :, None]), dim=2).repeat_interleave(H // KVH, dim=1)
    values = torch.cat((v[:, :, :p].float(), v_new.view(rows, KVH, 1, hd).to(v.dtype).float()), dim=2)
    values = values.repeat_interleave(H // KVH, dim=1)
    probs = torch.softmax(keys @ q[..., None] * hd**-0.5, dim=2)  # [rows, H, p + 1, 1]
    return (probs * values).sum(dim=2).reshape(rows, H * hd)


def with_tile(base: KernelPolicy, rows: int, n_heads: int, head_dim: int, tile: tuple[int, int, int]) -> Any:
    """`base` running `tile` (splits, keys per block, warps) at this launch shape; on an older tree (one
    `split_attention` tuple for every launch, `PYTHONPATH=<older checkout>/src`) through those fields."""
    if hasattr(base, "rope_attention_tiles"):
        return dataclasses.replace(base, rope_attention_tiles={(rows, n_heads, head_dim): tile})
    if tile[0] == 1:
        return dataclasses.replace(base, split_attention=None, attention_tile=tile[1:])  # type: ignore[call-arg]
    return dataclasses.replace(base, split_attention=tile)  # type: ignore[call-arg]


def policy_tile(base: Any, rows: int, n_heads: int, head_dim: int, keys: int) -> tuple[int, int, int]:
    """The policy's tile for a step over `keys` cached keys and the new one."""
    if hasattr(base, "attends_long_cache"):
        long_cache = base.attends_long_cache(rows, keys + 1)
        return tuple(base.rope_attention_tile(rows, n_heads, head_dim, long_cache))  # type: ignore[return-value]
    if hasattr(base, "rope_attention_tile"):
        return tuple(base.rope_attention_tile(rows, n_heads, head_dim))  # type: ignore[return-value]
    if base.split_attention is not None and head_dim >= base.split_attention_min_head_dim:
        return tuple(base.split_attention)  # type: ignore[return-value]
    return (1, *base.attention_block(head_dim))


def eager_us(fn: Any, calls: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) * 1e6 / calls


def measure(rows: int, positions: int, shape: Shape, variants: list[tuple[int, int, int]], base: KernelPolicy,
            args: argparse.Namespace, gen: torch.Generator, device: torch.device) -> dict[str, Any]:  # fmt: skip
    H, KVH, hd = shape.n_heads, shape.n_kv_heads, shape.head_dim
    nbytes = kv_bytes(rows, positions, shape)
    copies = 1 if args.smoke else max(2, min(args.max_copies, math.ceil(args.stream_mb * 1e6 / nbytes)))
    calls = copies * max(1, math.ceil(args.min_calls / copies))
    seq = positions + 1
    cache_shape = (copies, rows, KVH, seq, hd)
    k = torch.randn(cache_shape, generator=gen, device=device).to(shape.dtype)
    v = torch.randn(cache_shape, generator=gen, device=device).to(shape.dtype)
    qkv = torch.randn(rows, (H + 2 * KVH) * hd, generator=gen, device=device).to(shape.dtype)
    pos = torch.full((rows,), positions, dtype=torch.long, device=device)
    cos, sin = rope_tables(preset(args.preset), seq, device)
    ref = reference(qkv, k[0], v[0], pos, cos, sin, shape)
    chosen = policy_tile(base, rows, H, hd, positions)
    out: dict[str, Any] = {
        "rows": rows, "positions": positions, "kv_MB": nbytes / 1e6, "copies": copies, "calls_per_graph": calls,
        "streamed_MB": copies * nbytes / 1e6, "policy": list(chosen), "variants": [],
    }  # fmt: skip
    interleaved = shape.pairing == "interleaved"
    for tile in dict.fromkeys([*variants, chosen]):
        res: dict[str, Any] = {"splits": tile[0], "block": tile[1], "warps": tile[2], "policy": tile == chosen}
        try:
            ops = cuda_ops.CudaKernels(with_tile(base, rows, H, hd, tile))
            got = ops.rope_attention(qkv, OneTokenAttention(k[0], v[0], pos, cos, sin, H, KVH, hd, interleaved))
            res["max_abs_err"] = float((got.float() - ref).abs().max())
            res["matches_reference"] = res["max_abs_err"] <= TOLERANCE[shape.dtype]
            turn = iter(range(1 << 62))

            def call(ops: Any = ops, turn: Any = turn) -> torch.Tensor:
                i = next(turn) % copies
                return ops.rope_attention(qkv, OneTokenAttention(k[i], v[i], pos, cos, sin, H, KVH, hd, interleaved))

            us = eager_us(call, 2) if args.smoke else graph_us(call, calls, args.repeat)
            res.update(us=us, GBps=nbytes / us / 1e3, timing="eager (interpreter)" if args.smoke else "graph")
        except Exception as exc:  # one failing variant is a result, not the end of the run
            res["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out["variants"].append(res)
    return out


def print_row(r: dict[str, Any], sweep: list[tuple[int, int, int]]) -> None:
    by = {(v["splits"], v["block"], v["warps"]): v for v in r["variants"]}
    cells = []
    for tile in sweep:
        v = by[tile]
        cells.append(f"{v['us']:9.1f}" if "us" in v else f"{'fail':>9s}")
    pol = by[tuple(r["policy"])]
    timed = [v for v in r["variants"] if "us" in v]
    best = min(timed, key=lambda v: v["us"]) if timed else None
    worst_err = max((v["max_abs_err"] for v in r["variants"] if "max_abs_err" in v), default=math.nan)
    best_text = f"{best['splits']}/{best['block']}x{best['warps']} {best['us']:.1f}" if best else "-"
    pol_text = f"{pol['us']:8.1f} {pol['GBps']:7.0f}" if "us" in pol else f"{'fail':>16s}"
    print(f"{r['rows']:4d} {r['positions']:5d} {r['kv_MB']:8.2f} |{''.join(cells)} | "
          f"{pol['splits']:2d}/{pol['block']}x{pol['warps']} {pol_text} | {best_text:>16s} | {worst_err:.1e}",
          flush=True)  # fmt: skip


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The policy's choice against the fastest variant per size, and the variants that failed or missed."""
    ratios, failed, wrong = {}, [], []
    for r in runs:
        size = f"rows={r['rows']} positions={r['positions']}"
        timed = [v for v in r["variants"] if "us" in v]
        policy = next((v for v in timed if v["policy"]), None)
        if timed and policy is not None:
            ratios[size] = round(policy["us"] / min(v["us"] for v in timed), 3)
        failed += [f"{size} {v['splits']}/{v['block']}x{v['warps']}" for v in r["variants"] if "error" in v]
        wrong += [f"{size} {v['splits']}/{v['block']}x{v['warps']}" for v in r["variants"]
                  if v.get("matches_reference") is False]  # fmt: skip
    worst = max(ratios.values(), default=math.nan)
    return {"policy_over_best": ratios, "worst_policy_over_best": worst, "failed": failed, "off_reference": wrong}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--positions", type=int, nargs="*", default=list(POSITIONS), help="cached positions per row")
    ap.add_argument("--splits", type=int, nargs="*", default=list(SPLITS))
    ap.add_argument("--tiles", nargs="*", default=["64x4", "128x8"], help="keys per block x warps, each timed "
                    "at every split count (the policy's own choice is timed too)")  # fmt: skip
    ap.add_argument("--preset", default="seed-407m", help="the model whose heads are timed")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--pdl", action="store_true", help="launch with PDL as an engine on Hopper does (off: the "
                    "calls do not overlap, each one is timed whole)")  # fmt: skip
    ap.add_argument("--stream-mb", type=float, default=256.0, help="MB of cache one pass over the copies reads")
    ap.add_argument("--max-copies", type=int, default=256)
    ap.add_argument("--min-calls", type=int, default=32, help="calls per graph at least")
    ap.add_argument("--repeat", type=int, default=7, help="graph replays; the median is reported")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()

    cfg = preset(args.preset)
    shape = Shape(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_pairing, getattr(torch, args.dtype))
    base = KernelPolicy(pdl=args.pdl)
    if args.smoke:  # two heads, and the split rule as it would be at 16 heads of 128
        shape = dataclasses.replace(shape, n_heads=2, n_kv_heads=2, dtype=torch.float32)
        if hasattr(base, "split_attention_programs"):
            base = dataclasses.replace(base, split_attention_programs=base.split_attention_programs * 2 // cfg.n_heads)
        args.rows, args.positions, args.tiles = [1, 3], [5, 70], ["32x2"]
        args.splits = [s for s in args.splits if s <= 4] if args.splits != list(SPLITS) else [1, 2, 4]
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("attention_batched: no CUDA device; use --smoke under TRITON_INTERPRET=1 on the CPU")
    else:
        device = torch.device("cuda")
    sweep = [(s, *parse_tile(t)) for t in args.tiles for s in args.splits]
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "preset": args.preset,
        "heads": [shape.n_heads, shape.n_kv_heads, shape.head_dim], "dtype": str(shape.dtype), "pdl": args.pdl,
        "policy_rule": {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if "attention" in f.name
                        and "tiles" not in f.name},
        "source": cuda_ops.__file__,
        "timing": "eager, interpreter" if args.smoke else f"CUDA graph of calls cycling cache copies of >= "
                  f"{args.stream_mb:.0f} MB (L2 not resident); median of {args.repeat} replays",
        "runs": [],
    }  # fmt: skip
    head = "".join(f"{f'{s}/{b}x{w}':>9s}" for s, b, w in sweep)
    print(f"us per call (splits/keys per block x warps); {results['device']}, {shape.dtype}, pdl {args.pdl}")
    print(f"rows   pos    KV MB |{head} | policy      us    GB/s |  best (split/tile) | max err")
    for positions in args.positions:
        for rows in args.rows:
            run = measure(rows, positions, shape, sweep, base, args, gen, device)
            results["runs"].append(run)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # this size's cache copies go before the next size's
            print_row(run, sweep)
    results["summary"] = summary(results["runs"])
    print(json.dumps(results["summary"]))
    results["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{results['seconds']:.1f} s; results in {args.out}")


if __name__ == "__main__":
    main()
