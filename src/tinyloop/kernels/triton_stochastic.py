"""Triton kernels for cross-iteration rounding on CUDA (imported only when triton is).

`triton_effective_weight` draws a looped INT4 matrix's effective weight for one key, bit for bit the torch
reference (tinyloop/stochastic/rounding.py): the same PCG hash of each element's row-major index xor the
key, the same decision from its top 5 bits, the same float32 dequantization. `stochastic_linear` is the
dispatch kernel: for decode (at most MATVEC_ROWS rows) it draws the same weights in registers inside a
matrix-vector product, reading only the packed codes and the channel; otherwise it draws the weight once
and calls a dense matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tinyloop.stochastic.channels import Channel
from tinyloop.stochastic.pcg import MASK32, PCG_INCREMENT, PCG_MULTIPLIER, PCG_OUTPUT_MULTIPLIER, RANDOM_BITS
from tinyloop.stochastic.weight import ChanneledInt4Weight, StochasticInt4Weight

BLOCK = 512
MATVEC_ROWS = 4
# Kernels may only read module constants declared constexpr.
_MUL = tl.constexpr(PCG_MULTIPLIER)
_INC = tl.constexpr(PCG_INCREMENT)
_OUT_MUL = tl.constexpr(PCG_OUTPUT_MULTIPLIER)


@triton.jit
def _pcg(v):
    state = v * tl.full(v.shape, _MUL, tl.uint32) + tl.full(v.shape, _INC, tl.uint32)
    word = (state >> ((state >> 28) + 4)) ^ state
    word = word * tl.full(v.shape, _OUT_MUL, tl.uint32)
    return (word >> 22) ^ word


# A key of 1 would otherwise be specialised into a compile-time constant (and a kernel of its own).
@triton.jit(do_not_specialize=["key"])
def _effective_weight_kernel(
    packed_ptr,
    scale_ptr,
    min_ptr,
    channel_ptr,
    out_ptr,
    n_cols,
    group_size,
    key,
    IS_SIGN: tl.constexpr,
    BF16_BITS: tl.constexpr,
    SHIFT: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = cols < n_cols
    rows = row + tl.arange(0, 1)
    tile = _effective_tile(
        packed_ptr, scale_ptr, min_ptr, channel_ptr, rows, rows >= 0, cols, mask, n_cols, group_size, key,
        IS_SIGN, SHIFT,
    )  # fmt: skip
    w = tl.reshape(tile, (BLOCK_COLS,))
    if BF16_BITS:
        # Round to nearest even by hand: the interpreter's bfloat16 cast truncates, the GPU's rounds.
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + row * n_cols + cols, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + row * n_cols + cols, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _effective_tile(packed_ptr, scale_ptr, min_ptr, channel_ptr, rows, row_mask, offs_k, k_mask, K, group_size, key,
                    IS_SIGN: tl.constexpr, SHIFT: tl.constexpr):  # fmt: skip
    """Effective weights of rows x offs_k as float32 [BLOCK_N, BLOCK_K] (the same draw as the kernel above)."""
    mask = row_mask[:, None] & k_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    cols = offs_k[None, :]
    byte = tl.load(packed_ptr + rows64 * (K // 2) + cols // 2, mask=mask, other=0).to(tl.int32)
    q = tl.where(cols % 2 == 0, byte & 15, byte >> 4)
    r = (_pcg((rows64 * K + cols).to(tl.uint32) ^ key.to(tl.uint32)) >> SHIFT).to(tl.int32)
    if IS_SIGN:
        bits = tl.load(channel_ptr + rows64 * (K // 8) + cols // 8, mask=mask, other=0).to(tl.int32)
        up = ((bits >> (cols % 8)) & 1) == 1
        count = tl.full(r.shape, 8, tl.int32)
    else:
        nib = tl.load(channel_ptr + rows64 * (K // 2) + cols // 2, mask=mask, other=0).to(tl.int32)
        signed = 2 * tl.where(cols % 2 == 0, nib & 15, nib >> 4) - 15
        up = signed > 0
        count = tl.abs(signed)
    move = (r < count).to(tl.int32)
    code = tl.minimum(tl.maximum(q + tl.where(up, move, -move), 0), 15)
    g = rows64 * (K // group_size) + cols // group_size
    scale = tl.load(scale_ptr + g, mask=mask, other=0).to(tl.float32)
    minimum = tl.load(min_ptr + g, mask=mask, other=0).to(tl.float32)
    return code.to(tl.float32) * scale + minimum


@triton.jit(do_not_specialize=["key"])
def _stochastic_matvec_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    min_ptr,
    channel_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    key,
    stride_xm,
    stride_om,
    IS_SIGN: tl.constexpr,
    SHIFT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        w = _effective_tile(packed_ptr, scale_ptr, min_ptr, channel_ptr, rows, row_mask, offs_k, k_mask, K,
                            group_size, key, IS_SIGN, SHIFT)  # fmt: skip
        acc += tl.sum(w[None, :, :] * x[:, None, :], axis=2)
    mask = m_mask[:, None] & row_mask[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def stochastic_matvec(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    channel: torch.Tensor,
    kind: Channel,
    group_size: int,
    key: int,
) -> torch.Tensor:
    """x [M, K] (M <= MATVEC_ROWS) @ effective_weight.T, float32 accumulation, in x's dtype."""
    M, K = x.shape
    N = packed.shape[0]
    assert M <= MATVEC_ROWS and packed.shape[1] * 2 == K and x.stride(1) == 1
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_n = 32
    _stochastic_matvec_kernel[(triton.cdiv(N, block_n),)](
        x, packed, scale, minimum, channel, out, M, N, K, group_size, key & MASK32, x.stride(0), out.stride(0),
        IS_SIGN=kind == "sign", SHIFT=32 - RANDOM_BITS, ROWS=MATVEC_ROWS, BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip
    return out


def stochastic_linear(x: torch.Tensor, w: object) -> torch.Tensor:
    """The ('int4_stoch', 'cuda') dispatch kernel: x @ w_eff.T for a StochasticInt4Weight bound to an iteration."""
    assert isinstance(w, StochasticInt4Weight)
    key = w.key
    rows = x.reshape(-1, x.shape[-1])
    if key is None or rows.shape[0] > MATVEC_ROWS:
        return F.linear(x, w.dequantize(x.dtype))
    out = stochastic_matvec(
        rows.contiguous(), w.packed, w.scale, w.minimum, w.channel, w.channel_kind, w.group_size, key
    )
    return out.view(*x.shape[:-1], out.shape[-1])


def triton_effective_weight(
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    channel: torch.Tensor,
    kind: Channel,
    group_size: int,
    key: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The [out, in] effective weight in `dtype` (same bits as rounding.dequantize_codes(effective_codes))."""
    out_f, half = packed.shape
    in_f = 2 * half
    if out_f * in_f > MASK32 + 1:
        raise ValueError(f"a {out_f} x {in_f} matrix has more than 2^32 elements; the element counter would wrap")
    for t in (packed, scale, minimum, channel):
        assert t.is_contiguous() and t.device == packed.device
    bf16 = dtype == torch.bfloat16
    out = torch.empty((out_f, in_f), dtype=torch.int16 if bf16 else dtype, device=packed.device)
    grid = (out_f, triton.cdiv(in_f, BLOCK))
    _effective_weight_kernel[grid](
        packed, scale, minimum, channel, out, in_f, group_size, key & MASK32,
        IS_SIGN=kind == "sign", BF16_BITS=bf16, SHIFT=32 - RANDOM_BITS, BLOCK_COLS=BLOCK,
    )  # fmt: skip
    return out.view(torch.bfloat16) if bf16 else out


def draw_effective_weight(w: ChanneledInt4Weight, key: int, dtype: torch.dtype) -> torch.Tensor:
    """StochasticInt4Weight's `draw` on CUDA: triton_effective_weight of the weight's own tensors."""
    return triton_effective_weight(w.packed, w.scale, w.minimum, w.channel, w.channel_kind, w.group_size, key, dtype)
