"""The Gluon INT4 GEMV (src/tinyloop/kernels/gluon_gemv.py) over 1-8 rows of x, per tile, against what else a
few-row product can run: the one-row kernels once per row, the Triton INT4 kernels (blocked GEMV / split-K), what
the default policy runs (`policy`), torch's tinygemm INT4 kernel through the same launcher (`tinygemm`: what
batched steps of `KernelPolicy.tinygemm_min_rows` to `tinygemm_max_rows` rows multiply), and cuBLAS on a 16-bit
copy of the weight (what batched decode steps multiply when `KernelPolicy.dense_copy_min_rows` sends them
there). seed-407m's four layer products (the Ouro-1.4B shape has the same four), weights streamed from DRAM
(16 copies per shape cycled inside one CUDA graph), bfloat16 activations. Every result is checked against a
float32 product of the dequantized weight. Device only.

    PYTHONPATH=src python bench/gluon_gemv_rows.py --out rows.json [--rows 1 2 3 4 8] [--budget-s 300]

Writes, per shape and row count, each kernel's µs, error, registers and spills, and `best_tiles`: the fastest
tile per (N, K, act, rows), in the form `KernelPolicy.gluon_tiles` takes (bench/gpu_batched_decode.py --tiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Callable

import torch
import triton
from cuda_timing import graph_us

from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_ops
from tinyloop.kernels.cuda_backend import kernel_policy
from tinyloop.kernels.gluon_gemv import PRMT_HIGH_BYTE, _gemv_int4_gluon_kernel
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.quant import BlockedInt4Weight, CudaTinygemmWeight, quantize_int4

# name: (N, K, act, norm, residual) as the decode step calls them
SHAPES = {"qkv": (6144, 2048, 0, True, False), "o": (2048, 2048, 0, False, True),
          "gate_up": (11264, 2048, 1, True, False), "down": (2048, 5632, 0, False, True)}  # fmt: skip
# (weight rows per thread, lanes along rows, blocks per thread, warps along rows, warps along blocks)
CANDIDATES = [(4, 1, 1, 4, 1), (4, 1, 1, 2, 2), (4, 2, 1, 2, 1), (2, 1, 1, 4, 1), (2, 1, 1, 2, 2), (2, 2, 1, 2, 1),
              (2, 2, 1, 4, 1), (2, 1, 1, 8, 1), (2, 2, 1, 2, 2), (1, 1, 1, 4, 1), (1, 2, 1, 4, 1), (1, 1, 1, 2, 2),
              (1, 2, 1, 2, 2), (1, 4, 1, 2, 2)]  # fmt: skip
COPIES = 16


def fits(tile: tuple[int, ...], rows: int, act: int) -> bool:
    """Whether a thread's partial sums (weight rows x 4 words x rows of x, twice for SwiGLU) stay well inside
    the register file (more spilled when compiled offline for sm_90a)."""
    return tile[0] * tile[2] * 4 * (1 << (rows - 1).bit_length()) * (2 if act == 1 else 1) <= 32


def random_int4_copies(n: int, k: int, gen: torch.Generator, group: int = 64) -> list[BlockedInt4Weight]:
    """COPIES random INT4 matrices [n, k] on the GPU (weights ~ N(0, 1 / k)), so that cycling through them streams
    each call's weights from DRAM."""
    return [BlockedInt4Weight.from_int4(quantize_int4(torch.randn(n, k, generator=gen) / k**0.5, group)).to("cuda")
            for _ in range(COPIES)]  # fmt: skip


def copies_us(fn: Callable[[int], object]) -> float:
    """Median µs per call of fn(0..COPIES-1) captured in one graph (each call on another weight copy)."""
    copies = itertools.cycle(range(COPIES))
    return graph_us(lambda: fn(next(copies)), COPIES)


def keep_best(row: dict, max_rel_err: float, table: dict, key: str) -> str | None:
    """The fastest measured tile of row["tiles"] whose error is below `max_rel_err` (None where none is), noted
    in the row (best_tile, best_us) and as table[key] (the tile's numbers)."""
    ok = {t: v for t, v in row["tiles"].items() if "us" in v and v["rel_err"] < max_rel_err}
    if not ok:
        return None
    best = min(ok, key=lambda t: ok[t]["us"])
    row.update(best_tile=best, best_us=ok[best]["us"])
    table[key] = [int(v) for v in best.split(",")]
    return best


def fused_product(policy: KernelPolicy, x: torch.Tensor, weights: list, nw: torch.Tensor | None, act: int,
                  res: torch.Tensor | None) -> Callable[[int], torch.Tensor]:  # fmt: skip
    """i -> `fused_linear` of x with weights[i] and the shape's norm, activation and residual."""
    return lambda i: cuda_ops.fused_linear(policy, x, weights[i], norm_weight=nw, eps=1e-6, act=act, residual=res)


def print_row(shape: str, rows: int, row: dict) -> None:
    print(shape, rows, json.dumps({k: v for k, v in row.items() if k != "tiles"}), flush=True)


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def reference(x: torch.Tensor, dense: torch.Tensor, nw: torch.Tensor | None, act: int,
              residual: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    h = x.float()
    if nw is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()
    y = h @ dense.float().t()
    if act == 1:
        g, u = y.chunk(2, -1)
        y = torch.nn.functional.silu(g) * u
    return y + residual.float() if residual is not None else y


def launch_tile(x: torch.Tensor, w: BlockedInt4Weight, tile: tuple[int, ...], nw: torch.Tensor | None, act: int,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, object]:  # fmt: skip
    M, K = x.shape
    N = w.shape[0] // 2 if act == 1 else w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    r, lr, bpt, wr, wb = tile
    block_n, blocks = r * lr * wr, bpt * (16 // lr) * wb
    res = residual if residual is not None else out
    compiled = _gemv_int4_gluon_kernel[(triton.cdiv(N, block_n),)](
        x, w.packed.view(torch.int32), w.scale, w.minimum, out, res, nw if nw is not None else out, out, N, K, 1e-6,
        K // 8, K // 64, x.stride(0), out.stride(0), res.stride(0), PRMT_HIGH_BYTE, M=M, NORM=nw is not None,
        BIAS=False, ACT=act, RESIDUAL=residual is not None, R=r, LR=lr, BPT=bpt, WR=wr, WB=wb,
        EVEN=N % block_n == 0 and (K // 64) % blocks == 0, PDL=0, num_warps=wr * wb,
    )  # fmt: skip
    return out, compiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 3, 4, 8])
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop trying tiles after this long")
    args = ap.parse_args()
    t_start = time.perf_counter()
    policy = kernel_policy(RuntimeEnv.read())
    int4_triton = dataclasses.replace(policy, gluon_gemv_max_rows=0, staged_gemv=False, gluon_gemv=False)
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "gluon": policy.gluon_gemv, "shapes": {}, "best_tiles": {}}  # fmt: skip
    for name, (n, k, act, norm, resid) in SHAPES.items():
        ws = random_int4_copies(n, k, gen)
        dense = [cuda_ops.dequantize_int4(w, torch.bfloat16) for w in ws]
        tinygemm = [CudaTinygemmWeight.from_int4(w) for w in ws] if CudaTinygemmWeight.supports(ws[0]) else []
        nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dev, torch.bfloat16) if norm else None
        n_out = n // 2 if act == 1 else n
        entry: dict = {}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            res = torch.randn(m, n_out, generator=gen).to(dev, torch.bfloat16) if resid else None
            ref = reference(x, dense[0], nw, act, res)

            def err(got: torch.Tensor, ref: torch.Tensor = ref) -> float:
                return float((got.float() - ref).norm() / ref.norm())

            row: dict = {"tiles": {}}

            def fused(pol, weights, x=x, res=res, nw=nw, act=act):  # type: ignore[no-untyped-def]
                return fused_product(pol, x, weights, nw, act, res)

            def per_row(i, x=x, res=res, ws=ws, nw=nw, act=act):  # type: ignore[no-untyped-def]
                for r in range(x.shape[0]):
                    cuda_ops.fused_linear(policy, x[r : r + 1], ws[i], norm_weight=nw, eps=1e-6, act=act,
                                          residual=None if res is None else res[r : r + 1])  # fmt: skip

            for label, fn, check in (("cublas_16bit", fused(policy, dense), True),
                                     ("int4_triton", fused(int4_triton, ws), True),
                                     ("policy", fused(policy, ws), True),
                                     ("tinygemm", fused(policy, tinygemm), bool(tinygemm)),
                                     ("one_row_kernels_per_row", per_row, False)):  # fmt: skip
                try:
                    if check:
                        row[f"{label}_rel_err"] = err(fn(0))
                    row[f"{label}_us"] = round(copies_us(fn), 2)
                except Exception as exc:  # noqa: BLE001 - recorded; the other kernels are still measured
                    row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            mine = policy.gluon_tile(n_out, k, act, m)
            tiles = [mine] + [t for t in CANDIDATES if t != mine and fits(t, m, act)] if m > 1 else [mine]
            for tile in tiles:
                if time.perf_counter() - t_start > args.budget_s and tile != tiles[0]:
                    row["budget_exhausted"] = True
                    break
                key = ",".join(map(str, tile))
                try:
                    got, compiled = launch_tile(x, ws[0], tile, nw, act, res)
                    e = err(got)

                    def tile_call(i, t=tile, x=x, r=res, ws=ws, nw=nw, a=act):  # type: ignore[no-untyped-def]
                        return launch_tile(x, ws[i], t, nw, a, r)

                    us = copies_us(tile_call)
                    row["tiles"][key] = {"us": round(us, 2), "rel_err": e, "regs": getattr(compiled, "n_regs", None),
                                         "spills": getattr(compiled, "n_spills", None)}  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    row["tiles"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if keep_best(row, 0.01, result["best_tiles"], f"{n_out},{k},{act},{m}") is not None:
                row["policy_tile"] = ",".join(map(str, tiles[0]))
            entry[m] = row
            print_row(name, m, row)
        result["shapes"][name] = entry
        write_json(args.out, result)
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
