"""Gluon (Triton's explicit-layout dialect) GEMV for a few rows times a blocked INT4 matrix: the decode hot path.

Why Gluon: in plain Triton a weight tile and the x it multiplies each get the register layout the compiler
infers from their own loads, so x ends up loaded, converted and summed once per weight row
(`triton_matmul._gemv_blocked_int4_kernel`; 8.5-12.7 instructions per weight on sm_90). Here the layout is
written down: each thread holds R rows x 4 consecutive words of one 64-column block, and x lives in the
slice of that layout without the row dimension, so a thread loads, converts, scales (norm gain) and sums each
x value once for its R rows. Nibbles become floats with one byte permute (PRMT) per weight instead of a
shift, a mask and an OR. A thread also holds every row of x (M of them, a batched step's sequences), so each
weight is decoded once and read from memory once for all of them; with M = 1 the kernel compiles to the same
instructions as a one-row kernel.

Same weight layout (quant.BlockedInt4Weight, 64-column blocks), same arithmetic as the Triton kernel: per
block, sum_k x_k q_k = 16 (sum_k x_k (1 + q_k / 16) - sum_k x_k), then scale and minimum once per block.
CUDA only (Gluon has no interpreter); `available()` says whether the installed Triton can build it, and
cuda_ops falls back to the Triton kernel otherwise.
"""

from __future__ import annotations

from typing import Any

import triton.language as tl

try:  # Gluon is experimental: absent from older Triton, and its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    gluon = None
    gl = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def available() -> bool:
    return gluon is not None and hasattr(gl, "BlockedLayout") and hasattr(gl, "SliceLayout")


def _jit(fn: Any) -> Any:
    return gluon.jit(fn) if gluon is not None else fn


# The PRMT's constant operand, a kernel argument so that ptxas reads it from the constant bank (given as an
# immediate, ptxas puts it in the instruction and moves the selector into a register before every PRMT).
PRMT_HIGH_BYTE = 0x3F000000

# PRMT selectors that move byte b of a word to byte 2 under 0x3F (byte 3 of the constant operand), with zero
# low bytes: a byte 0x80 | q << 3 becomes the float32 1 + q / 16.
_PRMT = tl.constexpr(tuple(f"prmt.b32 $0, $1, $2, 0x7{b}44;" for b in range(4)))


@_jit
def _nibble_as_float(lo, hi, magic, J: gl.constexpr):
    """Nibble J of each word as the float32 1 + q / 16, from the words' byte-aligned even (lo) / odd (hi)
    nibbles."""
    if J % 2 == 0:
        src = lo
    else:
        src = hi
    bits = gl.inline_asm_elementwise(_PRMT[J // 2], "=r,r,r", [src, magic], dtype=gl.int32, is_pure=True, pack=1)
    return bits.to(gl.float32, bitcast=True)


@_jit
def _wait_for_previous_kernel():
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@_jit
def _launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)  # fmt: skip


@_jit
def _pdl_wait(PDL: gl.constexpr):
    """Programmatic dependent launch: wait until the previous kernel's writes are visible. PDL 1 then lets the
    next kernel launch, 2 lets it launch before the wait, 3 leaves that to `_pdl_end` after the kernel's stores.
    A no-op without PDL (0). As in triton_pdl, nothing read before it may be written by a kernel of the step."""
    if PDL == 2:
        _launch_dependents()
        _wait_for_previous_kernel()
    elif PDL:
        _wait_for_previous_kernel()
        if PDL == 1:
            _launch_dependents()


@_jit
def _pdl_end(PDL: gl.constexpr):
    """With PDL 3, let the next kernel launch now (at the end of the kernel)."""
    if PDL == 3:
        _launch_dependents()


@_jit
def _load_tile(w_tile, g_tile, s_ptr, m_ptr, kb, blk3, blk2, row_mask3, row_mask2, n_blocks, fetch, EVEN: gl.constexpr):
    """Words [rows, blocks, 8] of blocks kb.. (w_tile: their pointers for kb = 0) and their scales and
    minimums [rows, blocks] (g_tile: offsets for kb = 0). `fetch` false: nothing is read. Words of masked-off
    places are left undefined (they only ever meet x = 0, and any bit pattern dequantizes to a finite float);
    scales and minimums are zero there."""
    if EVEN:
        words = gl.load(w_tile + kb * 8, mask=fetch)
        s = gl.load(s_ptr + g_tile + kb, mask=fetch, other=0.0)
        mn = gl.load(m_ptr + g_tile + kb, mask=fetch, other=0.0)
    else:
        words = gl.load(w_tile + kb * 8, mask=row_mask3 & (blk3 + kb < n_blocks) & fetch)
        g_mask = row_mask2 & (blk2 + kb < n_blocks) & fetch
        s = gl.load(s_ptr + g_tile + kb, mask=g_mask, other=0.0)
        mn = gl.load(m_ptr + g_tile + kb, mask=g_mask, other=0.0)
    return words, s.to(gl.float32), mn.to(gl.float32)


@_jit
def _gemv_int4_gluon_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    out_ptr,
    res_ptr,
    nw_ptr,
    b_ptr,
    N,
    K,
    eps,
    stride_w,
    stride_g,
    stride_x,
    stride_out,
    stride_res,
    magic,
    M: gl.constexpr,
    NORM: gl.constexpr,
    BIAS: gl.constexpr,
    ACT: gl.constexpr,
    RESIDUAL: gl.constexpr,
    R: gl.constexpr,
    LR: gl.constexpr,
    BPT: gl.constexpr,
    WR: gl.constexpr,
    WB: gl.constexpr,
    EVEN: gl.constexpr,
    PDL: gl.constexpr,
):
    """out[m, n] = act(sum_k norm(x[m])_k w[n, k]) (+ residual[m, n]) for the M rows of x; rows pid * R * WR..
    of w. Each weight word is decoded once and multiplied with every row of x, which a thread holds whole."""
    MP: gl.constexpr = 1 << (M - 1).bit_length()
    L4: gl.constexpr = gl.BlockedLayout([MP, R, BPT, 4], [1, LR, 16 // LR, 2], [1, WR, WB, 1], [3, 2, 1, 0])
    W3: gl.constexpr = gl.SliceLayout(0, L4)  # [rows, blocks, words]: weight words, shared by the M rows of x
    X3: gl.constexpr = gl.SliceLayout(1, L4)  # [m, blocks, words]: x, shared by a thread's weight rows
    A3: gl.constexpr = gl.SliceLayout(3, L4)  # [m, rows, blocks]: per-block sums
    G2: gl.constexpr = gl.SliceLayout(0, A3)  # [rows, blocks]: scales and minimums
    Y2: gl.constexpr = gl.SliceLayout(2, A3)  # [m, rows]: results
    BN: gl.constexpr = R * LR * WR
    BB: gl.constexpr = BPT * (16 // LR) * WB
    n_blocks = K // 64
    row0 = gl.program_id(0) * BN

    rows_w = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, W3)))
    rows_w = gl.expand_dims(gl.expand_dims(rows_w, 1), 2)
    blk_w = gl.expand_dims(gl.expand_dims(gl.arange(0, BB, layout=gl.SliceLayout(0, gl.SliceLayout(2, W3))), 0), 2)
    words_w = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, W3))), 0), 0)
    blk_w = blk_w + words_w * 0
    row_mask_w = rows_w < N
    rows_g = gl.expand_dims(row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, G2)), 1)
    blk_g = gl.expand_dims(gl.arange(0, BB, layout=gl.SliceLayout(0, G2)), 0)
    row_mask_g = rows_g < N
    x_m = gl.expand_dims(gl.expand_dims(gl.arange(0, MP, layout=gl.SliceLayout(1, gl.SliceLayout(2, X3))), 1), 2)
    x_blk = gl.expand_dims(gl.expand_dims(gl.arange(0, BB, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3))), 0), 2)
    x_word = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, X3))), 0), 0)
    x_row = x_ptr + x_m * stride_x

    w_tile = w_ptr + rows_w * stride_w + blk_w * 8 + words_w
    g_tile = rows_g * stride_g + blk_g
    up_w = N * stride_w
    up_g = N * stride_g
    words, s, mn = _load_tile(w_tile, g_tile, s_ptr, m_ptr, 0, blk_w, blk_g, row_mask_w, row_mask_g, n_blocks,
                              n_blocks > 0, EVEN)  # fmt: skip
    words_up, s_up, mn_up = words, s, mn
    if ACT == 1:
        words_up, s_up, mn_up = _load_tile(w_tile + up_w, g_tile + up_g, s_ptr, m_ptr, 0, blk_w, blk_g, row_mask_w,
                                           row_mask_g, n_blocks, n_blocks > 0, EVEN)  # fmt: skip
    # Weights never depend on earlier kernels: the first tile is fetched before the grid-dependency wait.
    _pdl_wait(PDL)

    acc = gl.zeros([MP, BN, BB], gl.float32, layout=A3)
    acc_up = gl.zeros([MP, BN, BB], gl.float32, layout=A3)
    sumsq = gl.zeros([MP, BB, 8], gl.float32, layout=X3)
    for kb in range(0, n_blocks, BB):
        cur, cur_s, cur_mn, cur_up, cur_s_up, cur_mn_up = words, s, mn, words_up, s_up, mn_up
        more = kb + BB < n_blocks
        words, s, mn = _load_tile(w_tile, g_tile, s_ptr, m_ptr, kb + BB, blk_w, blk_g, row_mask_w, row_mask_g,
                                  n_blocks, more, EVEN)  # fmt: skip
        if ACT == 1:
            words_up, s_up, mn_up = _load_tile(w_tile + up_w, g_tile + up_g, s_ptr, m_ptr, kb + BB, blk_w, blk_g,
                                               row_mask_w, row_mask_g, n_blocks, more, EVEN)  # fmt: skip
        # Bytes 0x80 | q << 3 of the even (lo) and odd (hi) nibbles; >> is arithmetic, the mask drops the sign.
        lo = ((cur << 3) & 0x78787878) | -2139062144  # 0x80808080
        hi = ((cur >> 1) & 0x78787878) | -2139062144
        lo_up = lo
        hi_up = hi
        if ACT == 1:
            lo_up = ((cur_up << 3) & 0x78787878) | -2139062144
            hi_up = ((cur_up >> 1) & 0x78787878) | -2139062144
        x_cols = (kb + x_blk) * 64 + x_word
        x_mask = ((kb + x_blk) < n_blocks) & (x_m < M)
        part = gl.zeros([MP, BN, BB, 8], gl.float32, layout=L4)
        part_up = gl.zeros([MP, BN, BB, 8], gl.float32, layout=L4)
        xsum = gl.zeros([MP, BB, 8], gl.float32, layout=X3)
        for j in gl.static_range(8):
            if EVEN and M == MP:
                xj = gl.load(x_row + x_cols + 8 * j).to(gl.float32)
            else:
                xj = gl.load(x_row + x_cols + 8 * j, mask=x_mask, other=0.0).to(gl.float32)
            if NORM:
                sumsq += xj * xj
                if EVEN:
                    xj = xj * gl.load(nw_ptr + x_cols + 8 * j).to(gl.float32)
                else:
                    xj = xj * gl.load(nw_ptr + x_cols + 8 * j, mask=(kb + x_blk) < n_blocks, other=0.0).to(gl.float32)
            xsum += xj
            x4 = gl.expand_dims(xj, 1)
            part += gl.expand_dims(_nibble_as_float(lo, hi, magic, j), 0) * x4
            if ACT == 1:
                part_up += gl.expand_dims(_nibble_as_float(lo_up, hi_up, magic, j), 0) * x4
        xs = gl.sum(gl.expand_dims(xsum, 1), axis=3)  # [m, 1, blocks]
        acc += gl.expand_dims(cur_s, 0) * (16.0 * (gl.sum(part, axis=3) - xs)) + gl.expand_dims(cur_mn, 0) * xs
        if ACT == 1:
            acc_up += (
                gl.expand_dims(cur_s_up, 0) * (16.0 * (gl.sum(part_up, axis=3) - xs))
                + gl.expand_dims(cur_mn_up, 0) * xs
            )

    y = gl.sum(acc, axis=2)  # [m, rows]
    y_up = gl.sum(acc_up, axis=2)
    if NORM:
        rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(gl.expand_dims(sumsq, 1), axis=3), axis=2) / K + eps)  # [m, 1]
        y = y * rstd
        y_up = y_up * rstd
    out_rows = gl.expand_dims(row0 + gl.arange(0, BN, layout=gl.SliceLayout(0, Y2)), 0)
    out_m = gl.expand_dims(gl.arange(0, MP, layout=gl.SliceLayout(1, Y2)), 1)
    bias, res = _load_bias_residual(out_m, out_rows, N, M, b_ptr, res_ptr, stride_res, BIAS, RESIDUAL)
    _store_rows(y, y_up, out_m, out_rows, N, M, out_ptr, stride_out, bias, res, BIAS, ACT, RESIDUAL)
    _pdl_end(PDL)


@_jit
def _load_bias_residual(out_m, rows, N, M: gl.constexpr, b_ptr, res_ptr, stride_res, BIAS: gl.constexpr,
                        RESIDUAL: gl.constexpr):  # fmt: skip
    """Bias at `rows` and residual at (out_m, rows) as float32 (0 where absent), for _store_rows."""
    row_mask = rows < N
    bias = 0.0
    res = 0.0
    if BIAS:
        bias = gl.load(b_ptr + rows, mask=row_mask, other=0.0).to(gl.float32)
    if RESIDUAL:
        res = gl.load(res_ptr + out_m * stride_res + rows, mask=row_mask & (out_m < M), other=0.0).to(gl.float32)
    return bias, res


@_jit
def _store_rows(y, y_up, out_m, rows, N, M: gl.constexpr, out_ptr, stride_out, bias, res, BIAS: gl.constexpr,
                ACT: gl.constexpr, RESIDUAL: gl.constexpr):  # fmt: skip
    """out[out_m, rows] = act(y + bias) (+ res), y_up the SwiGLU up half. The same rounding steps as
    triton_matmul._epilogue (the CPU-tested one), in Gluon's ops on any row layout; keep the two in step."""
    dt = out_ptr.dtype.element_ty
    if BIAS:
        y = y + bias
    y = y.to(dt).to(gl.float32)
    if ACT == 1:
        up = y_up.to(dt).to(gl.float32)
        y = (y / (1.0 + gl.exp(-y))).to(dt).to(gl.float32) * up
    elif ACT == 2:
        y = 0.5 * y * (1.0 + gl.erf(y * 0.7071067811865476))
    if RESIDUAL:
        y = y.to(dt).to(gl.float32) + res
    gl.store(out_ptr + out_m * stride_out + rows, y.to(dt), mask=(rows < N) & (out_m < M))
