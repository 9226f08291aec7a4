# ruff: noqa: B023, F821  (closures are called inside their loop iteration; `del` frees each shape's copies)
"""INT4 one-row GEMV variants on the seed-407m shapes, timed back to back in a CUDA graph (one device call).

    PYTHONPATH=src python3 bench/int4_gemv_lab.py --out $OUT/gemv_lab.json

Compares the engine's kernel (cuda_ops.fused_linear) with experimental kernels in /tmp-free form here;
each variant is checked against a float64 product first. Weights are cycled through enough copies to
stream from DRAM, not L2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from gpu_suite import graph_time  # noqa: E402

from tinyloop.kernels import cuda_ops  # noqa: E402
from tinyloop.quant import Int4Weight  # noqa: E402

_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def gemv_blocked_magic(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    stride_g,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs_b = tl.arange(0, BLOCK_B)
    offs_i = tl.arange(0, 8)
    zero_rows = (rows * 0)[:, None, None]
    acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
    for kb in range(0, K // 64, BLOCK_B):
        blk = kb + offs_b
        mask3 = row_mask[:, None, None] & (blk < K // 64)[None, :, None]
        words = tl.load(
            w_ptr + rows[:, None, None] * stride_w + blk[None, :, None] * 8 + offs_i[None, None, :], mask=mask3, other=0
        ).to(tl.uint32, bitcast=True)
        part = tl.zeros((BLOCK_N, BLOCK_B, 8), tl.float32)
        xsum = tl.zeros((BLOCK_N, BLOCK_B, 8), tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(
                x_ptr + zero_rows + (blk * 64 + 8 * j)[None, :, None] + offs_i[None, None, :], mask=mask3, other=0.0
            ).to(tl.float32)
            q = (((words >> (4 * j)) & 0xF) | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC
            part += q * xj
            xsum += xj
        p = tl.sum(part, axis=2)
        xs = tl.sum(xsum, axis=2)
        g = (blk * 64) // GROUP
        gmask = row_mask[:, None] & (blk < K // 64)[None, :]
        s = tl.load(s_ptr + rows[:, None] * stride_g + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + rows[:, None] * stride_g + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        acc += s * p + mn * xs
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def gemv_blocked_onepointq(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    stride_g,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs_b = tl.arange(0, BLOCK_B)
    offs_i = tl.arange(0, 8)
    zero_rows = (rows * 0)[:, None, None]
    acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
    for kb in range(0, K // 64, BLOCK_B):
        blk = kb + offs_b
        mask3 = row_mask[:, None, None] & (blk < K // 64)[None, :, None]
        words = tl.load(
            w_ptr + rows[:, None, None] * stride_w + blk[None, :, None] * 8 + offs_i[None, None, :], mask=mask3, other=0
        )
        part = tl.zeros((BLOCK_N, BLOCK_B, 8), tl.float32)
        xsum = tl.zeros((BLOCK_N, BLOCK_B, 8), tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(
                x_ptr + zero_rows + (blk * 64 + 8 * j)[None, :, None] + offs_i[None, None, :], mask=mask3, other=0.0
            ).to(tl.float32)
            if j < 5:
                sh = words << (19 - 4 * j)
            else:
                sh = words >> (4 * j - 19)
            f = ((sh & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q / 16
            part += f * xj
            xsum += xj
        xs = tl.sum(xsum, axis=2)
        p = 16.0 * (tl.sum(part, axis=2) - xs)
        g = (blk * 64) // GROUP
        gmask = row_mask[:, None] & (blk < K // 64)[None, :]
        s = tl.load(s_ptr + rows[:, None] * stride_g + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + rows[:, None] * stride_g + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        acc += s * p + mn * xs
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def gemv_blocked_staged(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    stride_g,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs_b = tl.arange(0, BLOCK_B)
    offs_i = tl.arange(0, 8)
    zero_rows = (rows * 0)[:, None, None]
    acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
    for kb in tl.range(0, K // 64, BLOCK_B, num_stages=STAGES):
        blk = kb + offs_b
        mask3 = row_mask[:, None, None] & (blk < K // 64)[None, :, None]
        words = tl.load(
            w_ptr + rows[:, None, None] * stride_w + blk[None, :, None] * 8 + offs_i[None, None, :], mask=mask3, other=0
        )
        part = tl.zeros((BLOCK_N, BLOCK_B, 8), tl.float32)
        xsum = tl.zeros((BLOCK_N, BLOCK_B, 8), tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(
                x_ptr + zero_rows + (blk * 64 + 8 * j)[None, :, None] + offs_i[None, None, :], mask=mask3, other=0.0
            ).to(tl.float32)
            if j < 5:
                sh = words << (19 - 4 * j)
            else:
                sh = words >> (4 * j - 19)
            f = ((sh & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q / 16
            part += f * xj
            xsum += xj
        xs = tl.sum(xsum, axis=2)
        p = 16.0 * (tl.sum(part, axis=2) - xs)
        g = (blk * 64) // GROUP
        gmask = row_mask[:, None] & (blk < K // 64)[None, :]
        s = tl.load(s_ptr + rows[:, None] * stride_g + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + rows[:, None] * stride_g + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        acc += s * p + mn * xs
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def to_blocked(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 (column 2b low nibble, 2b+1 high) -> [N, K/8] int32, word i of 64-column block b
    holding column 64b + 8j + i in nibble j."""
    n, half = packed.shape
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, half // 32, 8, 8).to(torch.int64)
    shifts = (4 * torch.arange(8, device=packed.device)).view(1, 1, 8, 1)
    words = (q << shifts).sum(2).reshape(n, half // 4)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


SHAPES = {"qkv": (6144, 2048), "out": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
CONFIGS = [
    (4, 16, 4),
    (8, 16, 4),
    (16, 16, 4),
    (8, 8, 4),
    (16, 8, 4),
    (32, 8, 4),
    (16, 16, 8),
    (8, 32, 8),
    (32, 16, 8),
    (4, 32, 4),
    (2, 32, 2),
    (4, 8, 2),
]
VARIANTS = {"magic": gemv_blocked_magic, "onepointq": gemv_blocked_onepointq}
STAGED = [
    (bn, bb, w, st)
    for st in (2, 3, 4)
    for bn, bb, w in [(4, 8, 4), (8, 8, 4), (16, 4, 4), (4, 4, 2), (8, 4, 4), (16, 8, 8), (2, 8, 2), (4, 16, 4)]
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_lab.json")
    args = ap.parse_args()
    from tinyloop.kernels.cuda_backend import pdl_supported

    cuda_ops.USE_PDL = pdl_supported()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {},
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(24, int(600e6 // (n * k // 2))))
        ws = [
            Int4Weight(
                torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen),
                (torch.rand(n, k // 64, device="cuda", generator=gen) * 0.01).half(),
                (torch.rand(n, k // 64, device="cuda", generator=gen) * -0.05).half(),
                64,
            )
            for _ in range(copies)
        ]
        blocked = [to_blocked(w.packed) for w in ws]
        nbytes = ws[0].nbytes
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = (x.double() @ ws[0].dequantize(torch.float64).T).float()
        entry: dict[str, Any] = {"bytes": nbytes}
        it = iter(range(10**9))
        t = graph_time(lambda: cuda_ops.fused_linear(x, ws[next(it) % copies]), copies * 2)
        got = cuda_ops.fused_linear(x, ws[0]).float()
        entry["engine"] = {"us": t * 1e6, "GBps": nbytes / t / 1e9, "rel": float((got - ref).norm() / ref.norm())}
        runs = [(vn, kern, cfg + (0,)) for vn, kern in VARIANTS.items() for cfg in CONFIGS]
        runs += [("staged", gemv_blocked_staged, cfg) for cfg in STAGED]
        for vname, kern, (bn, bb, warps, stages) in runs:
            if True:
                out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
                key = f"{vname} {bn},{bb},{warps},{stages}"
                extra = {"STAGES": stages} if stages else {}

                def call(
                    i: int = 0,
                    kern: Any = kern,
                    bn: int = bn,
                    bb: int = bb,
                    warps: int = warps,
                    out: torch.Tensor = out,
                    extra: Any = extra,
                ) -> Any:
                    w = ws[i]
                    return kern[(triton.cdiv(n, bn),)](
                        x,
                        blocked[i],
                        w.scale,
                        w.minimum,
                        out,
                        n,
                        k,
                        k // 8,
                        k // 64,
                        GROUP=64,
                        BLOCK_N=bn,
                        BLOCK_B=bb,
                        num_warps=warps,
                        **extra,
                    )

                try:
                    ck = call()
                    info = {"regs": getattr(ck, "n_regs", None), "spills": getattr(ck, "n_spills", None)}
                    if name == "qkv":
                        sass = ck.asm.get("sass", "") if hasattr(ck, "asm") else ""
                        info["ldgsts"] = sass.count("LDGSTS")
                        info["ldg"] = sass.count("LDG")
                    rel = float((out.float() - ref).norm() / ref.norm())
                    it2 = iter(range(10**9))
                    t = graph_time(lambda: call(next(it2) % copies), copies * 2)
                    entry[key] = {"us": t * 1e6, "GBps": nbytes / t / 1e9, "rel": rel, **info}
                except Exception as exc:
                    entry[key] = {"error": str(exc)[:300]}
        best = min((v["us"], kk) for kk, v in entry.items() if isinstance(v, dict) and "us" in v)
        entry["best"] = best
        res["shapes"][name] = entry
        print(name, "engine", round(entry["engine"]["us"], 2), "best", best, flush=True)
        del ws, blocked
        torch.cuda.empty_cache()
    res["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(res, indent=1))
    for name, entry in res["shapes"].items():
        rows = sorted((v["us"], kk, v["rel"]) for kk, v in entry.items() if isinstance(v, dict) and "us" in v)
        print(name, [(kk, round(us, 2), f"{r:.1e}") for us, kk, r in rows[:6]])


if __name__ == "__main__":
    main()
