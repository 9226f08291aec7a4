"""Triton kernel for INT4 embedding rows: gather the token rows and dequantize them in one launch (the torch
path takes about 25 small kernels per decode step: index, unpack, scale, cast)."""

from __future__ import annotations

import triton
import triton.language as tl

from tinyloop.kernels.triton_pdl import _wait_for_previous_kernel


@triton.jit
def _int4_rows_kernel(
    ids_ptr,
    packed_ptr,
    scale_ptr,
    min_ptr,
    out_ptr,
    D,
    stride_p,
    stride_g,
    GROUP: tl.constexpr,
    BLOCKED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (r, c): out[r, c*BLOCK:] = the columns of weight row ids[r], q * scale + minimum in float32,
    rounded once to the output dtype. Plain layout (quant.Int4Weight): byte i // 2 holds column i, low nibble
    first; blocked (quant.BlockedInt4Weight): word i of a min(GROUP, 64)-column block holds its column
    (block / 8) j + i in nibble j."""
    _wait_for_previous_kernel(PDL)
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    tok = tl.load(ids_ptr + r).to(tl.int64)
    if BLOCKED:
        blk: tl.constexpr = min(GROUP, 64)
        within = cols % blk
        word_idx = (cols // blk) * (blk // 8) + within % (blk // 8)
        words = tl.load(packed_ptr.to(tl.pointer_type(tl.int32)) + tok * (stride_p // 4) + word_idx, mask=mask)
        q = (words >> (4 * (within // (blk // 8)))) & 0xF
    else:
        byte = tl.load(packed_ptr + tok * stride_p + cols // 2, mask=mask)
        q = (byte.to(tl.int32) >> (4 * (cols % 2))) & 0xF
    g = tok * stride_g + cols // GROUP
    s = tl.load(scale_ptr + g, mask=mask).to(tl.float32)
    m = tl.load(min_ptr + g, mask=mask).to(tl.float32)
    w = q.to(tl.float32) * s + m
    tl.store(out_ptr + r * D + cols, w.to(out_ptr.dtype.element_ty), mask=mask)
