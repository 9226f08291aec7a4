"""Triton elementwise kernels: SwiGLU over a [gate | up] matmul result (the many-row cuBLAS path) and the
loop input s + p (inside the decode chain, so programmatic dependent launch is not interrupted)."""

from __future__ import annotations

import triton
import triton.language as tl

from tinyloop.kernels.triton_pdl import _wait_for_previous_kernel


@triton.jit
def _swiglu_kernel(y_ptr, out_ptr, N, stride_y, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (m, j): out[m, j*BLOCK:] = silu(y[m, :N]) * y[m, N:] over one block of features, rounded like
    the reference (silu to the output dtype, then the product)."""
    _wait_for_previous_kernel(PDL)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = y_ptr + m * stride_y
    dt = out_ptr.dtype.element_ty
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + N + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
    tl.store(out_ptr + m * stride_out + offs, (silu * up).to(dt), mask=mask)


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = a + b over n contiguous elements, rounded once to the output dtype."""
    _wait_for_previous_kernel(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (a + b).to(out_ptr.dtype.element_ty), mask=mask)
