"""Experiment: the Gluon INT4 GEMV (src/tinyloop/kernels/gluon_gemv.py) over 2-4 rows of x at once, each weight
tile decoded once for all rows, against the kernels a 2-4-row step takes today (the Triton blocked GEMV, the
one-row Gluon GEMV once per row, cuBLAS on a 16-bit copy). seed-407m's four layer products, weights streamed
from DRAM (16 copies per shape cycled inside one CUDA graph). Correctness against a float32 dequantized product.

    PYTHONPATH=src python bench/experimental/gluon_gemv_rows.py --out rows.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_ops
from tinyloop.kernels.cuda_backend import kernel_policy
from tinyloop.kernels.gluon_gemv import (
    PRMT_HIGH_BYTE,
    _jit,
    _load_tile,
    _nibble_as_float,
    _pdl_end,
    _pdl_wait,
    gl,
)
from tinyloop.quant import BlockedInt4Weight, quantize_int4


@_jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, s_ptr, m_ptr, out_ptr, res_ptr, nw_ptr, b_ptr, M, N, K, eps, stride_w, stride_g, stride_x,
    stride_out, stride_res, magic,
    MP: gl.constexpr, NORM: gl.constexpr, BIAS: gl.constexpr, ACT: gl.constexpr, RESIDUAL: gl.constexpr,
    R: gl.constexpr, LR: gl.constexpr, BPT: gl.constexpr, WR: gl.constexpr, WB: gl.constexpr, EVEN: gl.constexpr,
    PDL: gl.constexpr,
):  # fmt: skip
    L4: gl.constexpr = gl.BlockedLayout([1, R, BPT, 4], [1, LR, 16 // LR, 2], [1, WR, WB, 1], [3, 2, 1, 0])
    W3: gl.constexpr = gl.SliceLayout(0, L4)  # [rows, blocks, words]
    W2: gl.constexpr = gl.SliceLayout(2, W3)  # [rows, blocks]
    XW: gl.constexpr = gl.SliceLayout(0, W3)  # [blocks, words]
    X3: gl.constexpr = gl.SliceLayout(1, L4)  # [m, blocks, words]
    A3: gl.constexpr = gl.SliceLayout(3, L4)  # [m, rows, blocks]
    G2: gl.constexpr = gl.SliceLayout(0, A3)  # [rows, blocks] as the accumulators see it
    Y2: gl.constexpr = gl.SliceLayout(2, A3)  # [m, rows]
    BN: gl.constexpr = R * LR * WR
    BB: gl.constexpr = BPT * (16 // LR) * WB
    n_blocks = K // 64

    rows = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, W2))
    rows2 = gl.expand_dims(rows, 1)
    row_mask2 = rows2 < N
    rows3 = gl.expand_dims(rows2, 2)
    row_mask3 = rows3 < N
    blk2 = gl.expand_dims(gl.arange(0, BB, layout=gl.SliceLayout(0, W2)), 0)
    words3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, XW)), 0), 0)
    blk3 = gl.expand_dims(blk2, 2) + words3 * 0

    xm = gl.expand_dims(gl.expand_dims(gl.arange(0, MP, layout=gl.SliceLayout(1, gl.SliceLayout(2, X3))), 1), 2)
    x_blk = gl.expand_dims(gl.expand_dims(gl.arange(0, BB, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3))), 0), 2)
    x_word = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3))), 0), 1)
    x_row_mask = xm < M

    w_tile = w_ptr + rows3 * stride_w + blk3 * 8 + words3
    g_tile = rows2 * stride_g + blk2
    up_w = N * stride_w
    up_g = N * stride_g
    words, s, mn = _load_tile(w_tile, g_tile, s_ptr, m_ptr, 0, blk3, blk2, row_mask3, row_mask2, n_blocks,
                              n_blocks > 0, EVEN)  # fmt: skip
    words_up, s_up, mn_up = words, s, mn
    if ACT == 1:
        words_up, s_up, mn_up = _load_tile(w_tile + up_w, g_tile + up_g, s_ptr, m_ptr, 0, blk3, blk2, row_mask3,
                                           row_mask2, n_blocks, n_blocks > 0, EVEN)  # fmt: skip
    _pdl_wait(PDL)

    acc = gl.zeros([MP, BN, BB], gl.float32, layout=A3)
    acc_up = gl.zeros([MP, BN, BB], gl.float32, layout=A3)
    sumsq = gl.zeros([MP, BB, 8], gl.float32, layout=X3)
    for kb in range(0, n_blocks, BB):
        cur, cur_s, cur_mn, cur_up, cur_s_up, cur_mn_up = words, s, mn, words_up, s_up, mn_up
        more = kb + BB < n_blocks
        words, s, mn = _load_tile(w_tile, g_tile, s_ptr, m_ptr, kb + BB, blk3, blk2, row_mask3, row_mask2, n_blocks,
                                  more, EVEN)  # fmt: skip
        if ACT == 1:
            words_up, s_up, mn_up = _load_tile(w_tile + up_w, g_tile + up_g, s_ptr, m_ptr, kb + BB, blk3, blk2,
                                               row_mask3, row_mask2, n_blocks, more, EVEN)  # fmt: skip
        lo = ((cur << 3) & 0x78787878) | -2139062144
        hi = ((cur >> 1) & 0x78787878) | -2139062144
        lo_up = lo
        hi_up = hi
        if ACT == 1:
            lo_up = ((cur_up << 3) & 0x78787878) | -2139062144
            hi_up = ((cur_up >> 1) & 0x78787878) | -2139062144
        x_cols = (kb + x_blk) * 64 + x_word
        x_mask = ((kb + x_blk) < n_blocks) & x_row_mask
        part = gl.zeros([MP, BN, BB, 8], gl.float32, layout=L4)
        part_up = gl.zeros([MP, BN, BB, 8], gl.float32, layout=L4)
        xsum = gl.zeros([MP, BB, 8], gl.float32, layout=X3)
        for j in gl.static_range(8):
            xj = gl.load(x_ptr + xm * stride_x + x_cols + 8 * j, mask=x_mask, other=0.0).to(gl.float32)
            if NORM:
                sumsq += xj * xj
                xj = xj * gl.load(nw_ptr + x_cols + 8 * j, mask=(kb + x_blk) < n_blocks, other=0.0).to(gl.float32)
            xsum += xj
            x4 = gl.expand_dims(xj, 1)
            part += gl.expand_dims(_nibble_as_float(lo, hi, magic, j), 0) * x4
            if ACT == 1:
                part_up += gl.expand_dims(_nibble_as_float(lo_up, hi_up, magic, j), 0) * x4
        xs = gl.sum(gl.expand_dims(xsum, 1), axis=3)  # [m, 1, blocks]
        cs = gl.expand_dims(gl.convert_layout(cur_s, G2), 0)
        cm = gl.expand_dims(gl.convert_layout(cur_mn, G2), 0)
        acc += cs * (16.0 * (gl.sum(part, axis=3) - xs)) + cm * xs
        if ACT == 1:
            cs_up = gl.expand_dims(gl.convert_layout(cur_s_up, G2), 0)
            cm_up = gl.expand_dims(gl.convert_layout(cur_mn_up, G2), 0)
            acc_up += cs_up * (16.0 * (gl.sum(part_up, axis=3) - xs)) + cm_up * xs

    y = gl.sum(acc, axis=2)  # [m, rows]
    y_up = gl.sum(acc_up, axis=2)
    if NORM:
        rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(sumsq, axis=2), axis=1) / K + eps)
        rstd2 = gl.expand_dims(gl.convert_layout(rstd, gl.SliceLayout(1, Y2)), 1)
        y = y * rstd2
        y_up = y_up * rstd2
    out_rows = gl.expand_dims(gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, Y2)), 0)
    out_m = gl.expand_dims(gl.arange(0, MP, layout=gl.SliceLayout(1, Y2)), 1)
    mask = (out_rows < N) & (out_m < M)
    dt = out_ptr.dtype.element_ty
    if BIAS:
        y = y + gl.load(b_ptr + out_rows, mask=out_rows < N, other=0.0).to(gl.float32)
    y = y.to(dt).to(gl.float32)
    if ACT == 1:
        up = y_up.to(dt).to(gl.float32)
        y = (y / (1.0 + gl.exp(-y))).to(dt).to(gl.float32) * up
    elif ACT == 2:
        y = 0.5 * y * (1.0 + gl.erf(y * 0.7071067811865476))
    if RESIDUAL:
        y = y.to(dt).to(gl.float32) + gl.load(res_ptr + out_m * stride_res + out_rows, mask=mask, other=0.0).to(
            gl.float32
        )
    gl.store(out_ptr + out_m * stride_out + out_rows, y.to(dt), mask=mask)
    _pdl_end(PDL)


def gemv_rows(policy, x, w, *, norm_weight=None, eps=1e-6, act=0, residual=None, tile=None):  # type: ignore[no-untyped-def]
    M, K = x.shape
    N = w.shape[0] // 2 if act == 1 else w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rows, lanes_rows, per_thread, warps_rows, warps_blocks = tile or policy.gluon_tile(N, K, act)
    block_n = rows * lanes_rows * warps_rows
    blocks = per_thread * (16 // lanes_rows) * warps_blocks
    res = residual if residual is not None else out
    nw = norm_weight if norm_weight is not None else out
    _gemv_rows_kernel[(triton.cdiv(N, block_n),)](
        x, w.packed.view(torch.int32), w.scale, w.minimum, out, res, nw, out, M, N, K, eps, K // 8, K // 64,
        x.stride(0), out.stride(0), res.stride(0), PRMT_HIGH_BYTE, MP=triton.next_power_of_2(M),
        NORM=norm_weight is not None, BIAS=False, ACT=act, RESIDUAL=residual is not None, R=rows, LR=lanes_rows,
        BPT=per_thread, WR=warps_rows, WB=warps_blocks, EVEN=N % block_n == 0 and (K // 64) % blocks == 0,
        num_warps=warps_rows * warps_blocks, PDL=0,
    )  # fmt: skip
    return out


def reference(x, dense, norm_weight, eps, act, residual):  # type: ignore[no-untyped-def]
    h = x.float()
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = h @ dense.float().t()
    if act == 1:
        g, u = y.chunk(2, -1)
        y = torch.nn.functional.silu(g) * u
    if residual is not None:
        y = y + residual.float()
    return y


def graph_time_us(fn, copies: int, replays: int = 20) -> float:  # type: ignore[no-untyped-def]
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * copies))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gluon_gemv_rows.json")
    parser.add_argument("--copies", type=int, default=16)
    args = parser.parse_args()
    policy = kernel_policy(RuntimeEnv.read())
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    shapes = {"qkv": (6144, 2048, 0, True, False), "o": (2048, 2048, 0, False, True),
              "gate_up": (11264, 2048, 1, True, False), "down": (2048, 5632, 0, False, True)}  # fmt: skip
    result: dict = {"device": torch.cuda.get_device_name(), "policy_gluon": policy.gluon_gemv, "shapes": {}}
    for name, (n, k, act, norm, resid) in shapes.items():
        ws = []
        for _ in range(args.copies):
            raw = torch.randn(n, k, generator=gen) / k**0.5
            ws.append(BlockedInt4Weight.from_int4(quantize_int4(raw, 64)).to(dev))
        dense = [cuda_ops.dequantize_int4(w, torch.bfloat16) for w in ws]
        nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dev, torch.bfloat16) if norm else None
        entry: dict = {}
        for m in (1, 2, 3, 4, 8):
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            n_out = n // 2 if act == 1 else n
            res = torch.randn(m, n_out, generator=gen).to(dev, torch.bfloat16) if resid else None
            row: dict = {}
            ref = reference(x, dense[0], nw, 1e-6, act, res)
            try:
                got = gemv_rows(policy, x, ws[0], norm_weight=nw, act=act, residual=res)
                row["rows_kernel_rel_err"] = float((got.float() - ref).norm() / ref.norm())
                row["rows_kernel_us"] = graph_time_us(
                    lambda i, x=x, res=res, ws=ws, nw=nw, act=act: gemv_rows(
                        policy, x, ws[i], norm_weight=nw, act=act, residual=res
                    ),
                    args.copies,
                )
            except Exception as exc:  # noqa: BLE001 - recorded, the other kernels still measured
                row["rows_kernel_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"

            def today(i, x=x, res=res, ws=ws, dense=dense, nw=nw, act=act):  # type: ignore[no-untyped-def]
                return cuda_ops.fused_linear(policy, x, ws[i], norm_weight=nw, eps=1e-6, act=act, residual=res)

            got = today(0)
            row["today_rel_err"] = float((got.float() - ref).norm() / ref.norm())
            row["today_us"] = graph_time_us(today, args.copies)

            def per_row(i, x=x, res=res, ws=ws, dense=dense, nw=nw, act=act):  # type: ignore[no-untyped-def]
                for r in range(x.shape[0]):
                    cuda_ops.fused_linear(policy, x[r : r + 1], ws[i], norm_weight=nw, eps=1e-6, act=act,
                                          residual=None if res is None else res[r : r + 1])  # fmt: skip

            row["one_row_gluon_per_row_us"] = graph_time_us(per_row, args.copies)

            def cublas(i, x=x, res=res, ws=ws, dense=dense, nw=nw, act=act):  # type: ignore[no-untyped-def]
                return cuda_ops.fused_linear(policy, x, dense[i], norm_weight=nw, eps=1e-6, act=act, residual=res)

            row["cublas_16bit_us"] = graph_time_us(cublas, args.copies)
            entry[m] = row
            print(name, m, json.dumps(row), flush=True)
        result["shapes"][name] = entry
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
