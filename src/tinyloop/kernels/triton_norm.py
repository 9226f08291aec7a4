"""Triton RMSNorm kernel with the residual placements a layer needs (pre, sandwich-out, sandwich-sum)."""

from __future__ import annotations

import triton
import triton.language as tl

from tinyloop.kernels.triton_pdl import _wait_for_previous_kernel


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    D,
    eps,
    stride_x,
    stride_r,
    stride_o,
    MODE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row i. MODE 0: norm(x); 1: res + norm(x); 2: norm(x + res). Rounds like the reference: the
    normalised value to the compute dtype, then times the weight in it."""
    _wait_for_previous_kernel(PDL)
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + i * stride_x + offs, mask=mask, other=0.0)
    dt = x.dtype
    if MODE == 2:
        x = (x.to(tl.float32) + tl.load(res_ptr + i * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    y = ((xf * rstd).to(dt).to(tl.float32) * w).to(dt)
    if MODE == 1:
        y = (y.to(tl.float32) + tl.load(res_ptr + i * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
    tl.store(out_ptr + i * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
