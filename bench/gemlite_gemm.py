"""GemLite's INT4 GEMM (PyPI `gemlite`, Triton kernels for low-bit weights) against what a TinyLoop prefill runs
today — cuBLAS on the dequantized 16-bit weight, and dequantize + cuBLAS for matrices used once — per seed-407m
matrix and row count, weights streamed from DRAM (copies cycled inside one CUDA graph), with each product's
error against float64: a low-bit GEMM library as a peer of the prefill path (docs/BENCHMARKS.md, "The floor of a
chain of dependent phases"). Device only; GemLite is not a dependency of the package.

GemLite installs nowhere on the device, so carry it as a wheel (pure Python; needs numpy, tqdm, triton >= 3.6):

    pip wheel --no-deps gemlite==0.6.0.post2 -w .whl        # here, once (.whl is git-ignored)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gemlite-*.whl && \
        PYTHONPATH=src:/tmp/site python3 bench/gemlite_gemm.py --out $OUT/gemlite.json

GemLite's weight format is W ≈ q·scale + zero (its fma mode), the same as ours with zero = minimum, so the codes,
scales and minimums are passed through unchanged; bfloat16 inputs get the scales and minimums rounded to
bfloat16 (GemLite's metadata takes the input dtype), float16 inputs keep them exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
from cuda_timing import graph_us, timed

from tinyloop.kernels.cuda_ops import dequantize_int4
from tinyloop.quant import BlockedInt4Weight

SHAPES = ("qkv", "out", "gate_up", "down")
ROWS = (16, 32, 64, 128, 256, 1024)
APPLICATIONS = 36  # seed-407m at 8 loops: 2 + 4 x 8 + 2 layer applications per prefill


SEED_SHAPES = {  # name: (N, K, act); act 1 (SwiGLU) reads 2N rows
    "qkv": (6144, 2048, 0), "out": (2048, 2048, 0), "gate_up": (5632, 2048, 1), "down": (2048, 5632, 0),
}  # fmt: skip


def random_int4_copies(n_rows: int, k: int, gen: torch.Generator, group: int = 64) -> list[BlockedInt4Weight]:
    """Enough distinct random INT4 matrices that cycling through them streams from DRAM, not the L2."""
    copies = max(2, min(24, int(600e6 // (n_rows * k // 2))))
    return [BlockedInt4Weight(torch.randint(0, 256, (n_rows, k // 2), dtype=torch.uint8, device="cuda", generator=gen),
                              (torch.rand(n_rows, k // group, device="cuda", generator=gen) * 0.01).half(),
                              (torch.rand(n_rows, k // group, device="cuda", generator=gen) * -0.05).half(), group)
            for _ in range(copies)]  # fmt: skip


def gemlite_linear(w: BlockedInt4Weight, dtype: torch.dtype) -> Any:
    import gemlite

    n, k = w.shape
    gl_dtype = gemlite.DType.BF16 if dtype == torch.bfloat16 else gemlite.DType.FP16
    lin = gemlite.GemLiteLinear(
        4, group_size=w.group_size, in_features=k, out_features=n, input_dtype=gl_dtype, output_dtype=gl_dtype
    )
    scale = w.scale.to(dtype)
    lin.pack(w.codes(w.packed).contiguous(), scale, torch.zeros_like(scale), fma_mode=True)
    # fma mode stores -zeros * scales; ours is the minimum itself (W = q * scale + minimum).
    lin.zeros.data.copy_(w.minimum.to(dtype).t())
    return lin


def error(out: torch.Tensor, x: torch.Tensor, w: BlockedInt4Weight) -> float:
    ref = x.double() @ w.dequantize(torch.float64).t()
    return float((out.double() - ref).norm() / ref.norm())


def cycle(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    it = iter(range(10**12))
    return lambda: fns[next(it) % len(fns)]()


def us_per_call(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    """Inside one CUDA graph where it captures, else eager with a synchronize per round."""
    fn()
    try:
        return {"us": graph_us(fn, calls), "timing": "graph"}
    except Exception as exc:  # a kernel that does not capture: say so and time it eagerly
        torch.cuda.synchronize()
        t = statistics.median(timed(lambda: [fn() for _ in range(calls)], 10)) / calls
        return {"us": t * 1e6, "timing": f"eager ({type(exc).__name__})"}


def measure(name: str, rows_list: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:
    n, k, act = SEED_SHAPES[name]
    ws = random_int4_copies(2 * n if act == 1 else n, k, gen)
    dense = [dequantize_int4(w, dtype) for w in ws]
    lins = [gemlite_linear(w, dtype) for w in ws]
    out: dict[str, Any] = {"copies": len(ws), "weight_MB": ws[0].nbytes / 1e6}
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
        res: dict[str, Any] = {
            "error_gemlite": error(lins[0](x), x, ws[0]),
            "error_cublas": error(x @ dense[0].t(), x, ws[0]),
        }
        calls = 2 * len(ws)
        res["gemlite"] = us_per_call(cycle([lambda lin=lin, x=x: lin(x) for lin in lins]), calls)
        res["cublas_dense"] = us_per_call(cycle([lambda d=d, x=x: x @ d.t() for d in dense]), calls)
        res["dequantize_cublas"] = us_per_call(
            cycle([lambda w=w, x=x: x @ dequantize_int4(w, dtype).t() for w in ws]), calls
        )
        out[f"rows={rows}"] = res
        print(
            f"{name:8s} {str(dtype)[6:]:9s} rows {rows:5d}: gemlite {res['gemlite']['us']:8.1f} us "
            f"({res['gemlite']['timing']}), cuBLAS on 16-bit {res['cublas_dense']['us']:8.1f}, dequantize + cuBLAS "
            f"{res['dequantize_cublas']['us']:8.1f}; error vs float64 {res['error_gemlite']:.1e} / "
            f"{res['error_cublas']:.1e}",
            flush=True,
        )
    del ws, dense, lins
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"])
    ap.add_argument("--config", help="a GemLite autotune cache (default: its h100.json)")
    ap.add_argument("--autotune", choices=["fast", "max"], help="tune GemLite's kernels on this GPU instead of a cache")
    args = ap.parse_args()
    import gemlite

    if args.autotune:
        gemlite.set_autotune(args.autotune)
        config, loaded = f"autotune={args.autotune}", None
    else:
        config = args.config or os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
        loaded = gemlite.GemLiteLinear.load_config(config)
    res: dict[str, Any] = {"gemlite": getattr(gemlite, "__version__", "?"), "config": config, "loaded": loaded}
    res["device"] = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        per = res.setdefault(dtype_name, {})
        for name in SHAPES:
            per[name] = measure(name, tuple(args.rows), dtype, gen)
        for rows in args.rows:
            key = f"rows={rows}"
            totals = {
                v: sum(per[s][key][v]["us"] for s in SHAPES) * APPLICATIONS / 1e3 for v in ("gemlite", "cublas_dense")
            }
            per[f"prefill_{rows}_gemm_ms"] = totals
            print(f"{dtype_name} prefill {rows}: the 36 layer applications' GEMMs {totals}", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
