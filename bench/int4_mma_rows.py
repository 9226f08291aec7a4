"""The tensor-core INT4 kernel (src/tinyloop/kernels/gluon_int4_mma.py) at 3-64 rows of x against what batched
decode steps multiply today: cuBLAS on a 16-bit copy of the weight and torch's tinygemm INT4 kernel (both
through the same launcher, with the epilogues each path runs). seed-407m's four layer products (the Ouro-1.4B
shape has the same four), weights streamed from DRAM (16 copies per shape cycled inside one CUDA graph),
bfloat16 activations, relative error against float32 of the dequantized INT4 weight. Each row count also tries
a few tiles (`KernelPolicy.mma_int4_tiles`) and split counts (`mma_int4_programs`). Device only.

    PYTHONPATH=src python bench/int4_mma_rows.py --out F.json [--rows 3 4 8 16 32 64] [--budget-s 240] \\
        [--policy mma_int4_wgmma_loads_ahead=1] [--no-baselines] [--programs 132 264] [--group 32]

--group: the INT4 group size of the random matrices (64, seed-407m's, by default; 32 and 128 check the kernel's
other group layouts against float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import triton
from gluon_gemv_rows import (
    SHAPES,
    copies_us,
    fused_product,
    keep_best,
    print_row,
    random_int4_copies,
    reference,
    write_json,
)
from gpu_batched_decode import parse_overrides

from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_ops
from tinyloop.kernels.cuda_backend import kernel_policy
from tinyloop.quant import INT4_GROUP_SIZES, CudaMmaInt4Weight, CudaTinygemmWeight

SPLIT_PROGRAMS = (132, 264, 528, 1056)  # 132: one program an SM, gate / up at 32-64 rows without a K split


def tile_candidates(rows: int, wgmma: bool = False) -> list[tuple[int, int, int, int]]:
    """(warps, row tiles, BLOCK_K, x rows per program) worth timing at `rows` rows (`wgmma`: for the warpgroup
    kernel, whole warpgroups)."""
    rows_x = max(16, 1 << (rows - 1).bit_length())
    if wgmma:
        halves = [(4, 2, 128, 32), (8, 1, 128, 32)] if rows_x == 64 else []  # two x tiles of 32 rows
        # one warpgroup of one row tile: the fewest registers, so the most programs an SM holds
        small = [(4, 1, 128, rows_x)] if rows_x <= 32 else []
        return [(8, 1, 128, rows_x), (8, 1, 64, rows_x), (8, 2, 128, rows_x), (4, 2, 128, rows_x), *halves, *small]
    if rows_x == 64:
        return [(4, 1, 64, 64), (4, 2, 64, 64), (2, 1, 64, 64)]
    if rows_x == 32:
        return [(4, 1, 128, 32), (4, 2, 128, 32), (4, 1, 64, 32)]
    return [(4, 1, 128, 16), (4, 2, 128, 16), (2, 1, 128, 16), (4, 1, 256, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="*", default=[2, 3, 4, 8, 16, 32, 64])
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop the tile sweep after this long")
    ap.add_argument("--policy", nargs="*", default=[], help="KernelPolicy fields to replace, as FIELD=VALUE")
    ap.add_argument("--no-baselines", action="store_true", help="time the tensor-core kernel only")
    ap.add_argument("--programs", type=int, nargs="+", default=list(SPLIT_PROGRAMS), help="split K until about")
    ap.add_argument("--group", type=int, choices=INT4_GROUP_SIZES, default=64, help="INT4 group size")
    args = ap.parse_args()
    t_start = time.perf_counter()
    policy = dataclasses.replace(kernel_policy(RuntimeEnv.read()), mma_int4=True, **parse_overrides(args.policy, None))
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "group": args.group, "shapes": {}, "best": {}}  # fmt: skip
    for shape_index, (name, (n, k, act, norm, resid)) in enumerate(SHAPES.items()):
        deadline = t_start + args.budget_s * (shape_index + 1) / len(SHAPES)
        ws = random_int4_copies(n, k, gen, args.group)
        dense = [cuda_ops.dequantize_int4(w, torch.bfloat16) for w in ws]
        tinygemm = [CudaTinygemmWeight.from_int4(w) for w in ws]
        mma = [CudaMmaInt4Weight.from_int4(w, torch.bfloat16) for w in ws]
        nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dev, torch.bfloat16) if norm else None
        n_out = n // 2 if act == 1 else n
        entry: dict = {}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            res = torch.randn(m, n_out, generator=gen).to(dev, torch.bfloat16) if resid else None
            ref = reference(x, dense[0], nw, act, res)
            row: dict = {"tiles": {}}

            def fused(pol, weights, x=x, res=res, nw=nw, act=act):  # type: ignore[no-untyped-def]
                return fused_product(pol, x, weights, nw, act, res)

            def measure(label: str, fn, row=row, ref=ref) -> None:  # type: ignore[no-untyped-def]
                try:
                    got = fn(0)
                    row[label] = {"us": round(copies_us(fn), 2),
                                  "rel_err": float((got.float() - ref).norm() / ref.norm())}  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - recorded; the other kernels are still measured
                    row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}

            if not args.no_baselines:
                measure("cublas_16bit", fused(policy, dense))
                measure("tinygemm", fused(policy, tinygemm))
            measure("mma_int4", fused(policy, mma))
            wgmma = policy.mma_int4_wgmma
            if wgmma:
                measure("mma_sync", fused(dataclasses.replace(policy, mma_int4_wgmma=False), mma))
            for tile, programs in [
                (tile, programs) for tile in tile_candidates(m, wgmma) for programs in args.programs
            ]:
                if time.perf_counter() > deadline:
                    row["budget_exhausted"] = True
                    break
                # split K until `programs` run, however many splits that makes
                pol = dataclasses.replace(policy, mma_int4_tiles={(n, k, m): tile}, mma_int4_programs=programs,
                                          mma_int4_wgmma_programs=programs,
                                          mma_int4_wgmma_split_rows=1 << 20)  # fmt: skip
                key = ",".join(map(str, (*tile, programs)))
                measure(key, fused(pol, mma), row=row["tiles"])
            keep_best(row, 0.02, result["best"], f"{n},{k},{m}")
            entry[m] = row
            print_row(name, m, row)
        result["shapes"][name] = entry
        write_json(args.out, result)
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
