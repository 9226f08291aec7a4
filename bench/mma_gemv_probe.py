"""Probe (device only): does the INT4 -> bf16 pair dequantization land in mma.sync's A-operand registers
with a trivial layout conversion, and does the column order come out right? 16 rows x 64 columns, one warp.

    PYTHONPATH=src python3 bench/mma_gemv_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from tinyloop.quant import BlockedInt4Weight, quantize_int4

PAIR = tl.constexpr(tuple(
    f"{{ .reg .b32 t; shr.u32 t, $1, {4 * s}; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea; }}" if s else
    "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xea;" for s in range(4)))  # fmt: skip


@gluon.jit
def probe(w_ptr, x_ptr, out_ptr, stride_w):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    WL: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0])
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, WL))
    wi = gl.arange(0, 8, layout=gl.SliceLayout(0, WL))
    words = gl.load(w_ptr + gl.expand_dims(rows, 1) * stride_w + gl.expand_dims(wi, 0))
    both = gl.join(words, words)
    d0 = gl.inline_asm_elementwise(PAIR[0], "=r,r,r", [both], dtype=gl.bfloat16, is_pure=True, pack=2)
    d1 = gl.inline_asm_elementwise(PAIR[1], "=r,r,r", [both], dtype=gl.bfloat16, is_pure=True, pack=2)
    d2 = gl.inline_asm_elementwise(PAIR[2], "=r,r,r", [both], dtype=gl.bfloat16, is_pure=True, pack=2)
    d3 = gl.inline_asm_elementwise(PAIR[3], "=r,r,r", [both], dtype=gl.bfloat16, is_pure=True, pack=2)
    d = gl.join(gl.join(d0, d1), gl.join(d2, d3))  # [16, 8(i), 2(e), 2(s_lo), 2(s_hi)]
    d = gl.permute(gl.reshape(d, [16, 4, 2, 2, 2, 2]), [0, 5, 4, 2, 1, 3])  # [row, s_hi, s_lo, w, a, e]
    a = gl.convert_layout(gl.reshape(d, [16, 64]), A_L, assert_trivial=True)
    k = gl.arange(0, 64, layout=gl.SliceLayout(1, B_L))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, B_L))
    col = 8 * (k // 16 + 4 * (k % 2)) + 2 * ((k // 2) % 4) + (k // 8) % 2
    xb = gl.load(x_ptr + gl.expand_dims(col, 1) + gl.expand_dims(n, 0) * 0, mask=gl.expand_dims(n, 0) == 0, other=0.0)
    acc = mma_v2(a, xb, gl.zeros([16, 8], gl.float32, layout=mma))
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + gl.expand_dims(r, 1) + gl.expand_dims(c, 0) * 0, acc, mask=gl.expand_dims(c, 0) == 0)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    q = quantize_int4(torch.randn(16, 64, generator=gen), 64)
    w = BlockedInt4Weight.from_int4(q)
    codes = q.codes(q.packed).double()  # [16, 64] natural column order
    x = torch.randn(64, generator=gen).bfloat16()
    ref = (codes + 128) @ x.double()
    out = torch.zeros(16, device="cuda")
    probe[(1,)](w.packed.view(torch.int32).cuda(), x.cuda(), out, 8, num_warps=1)
    err = float((out.double().cpu() - ref).abs().max() / ref.abs().max())
    print("mma probe: max rel err", err, "triton", triton.__version__, "ok" if err < 1e-5 else "WRONG")


if __name__ == "__main__":
    main()
