"""Triton matrix kernels for CUDA: INT4 (or 16-bit) weights with the norm, bias, SwiGLU and residual fused in.

- `_gemv_blocked_int4_kernel` for 1-4 rows (decode) of INT4 weights in the blocked layout, the layout
  CUDA engines repack their INT4 matrices into (quant.BlockedInt4Weight).
- `_splitk_blocked_int4_kernel` + `_splitk_epilogue_kernel` for more rows of blocked INT4 weights
  (speculative verification, batched decode; any row count with cuBLAS switched off): tensor-core
  products split over K, then summed.
- `_matvec_kernel` for 1-4 rows of any other weight (16-bit, or INT4 in the file's plain layout): a weight
  tile is dequantized once and multiplied with every row on CUDA cores.
`_matvec_kernel` and `_dequant_kernel` share the weight-tile loader `_load_w`.

INT4 plain layout: the file's packed bytes viewed as int32 words [N, K/8]; nibble j of word w is column
8w + j (low nibble first), value = q * scale[n, g] + minimum[n, g] with g = column // group. Blocked
layout: word i of each BLOCK-column block (BLOCK = min(group, 64)) holds column (BLOCK / 8) j + i.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyloop.kernels.triton_pdl import _wait_for_previous_kernel

# 2**23 as float32 bits: OR-ing a 4-bit value into the mantissa and subtracting 2**23 converts it
# exactly, with integer and add units instead of the slower int-to-float conversion.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _row_rstd(x_ptr, stride_xm, offs_m, m_mask, K, eps, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) for rows offs_m of x."""
    acc = tl.zeros((offs_m.shape[0],), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & (offs_k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(acc / K + eps)


@triton.jit
def _load_x(x_ptr, stride_xm, offs_m, m_mask, offs_k, k_mask, nw_ptr, rstd, NORM: tl.constexpr):
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
    )
    if NORM:
        # Same rounding as the reference norm: normalise in float32, round, scale in the compute dtype.
        dt = x.dtype
        g = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(dt).to(tl.float32)
        x = ((x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt)
    return x


@triton.jit
def _load_w(
    w_ptr,
    s_ptr,
    m_ptr,
    rows,
    row_mask,
    k0,
    K,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCKED: tl.constexpr = 0,
):
    """Weight rows `rows`, columns k0..k0+BLOCK_K, as float32 [BLOCK_N, BLOCK_K] (zeros past K). BLOCKED:
    0 for the plain layout, else the block width of the blocked layout (BLOCK_K, k0 multiples of it)."""
    if INT4:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(
            w_ptr + rows[:, None] * (K // 8) + offs_w[None, :],
            mask=row_mask[:, None] & (offs_w[None, :] < K // 8),
            other=0,
        )
        shifts = tl.arange(0, 8) * 4
        q = (words[:, :, None] >> shifts[None, None, :]) & 0xF
        qf = (q | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC
        if BLOCKED:  # [n, block, i, j] -> column order [n, block, j, i]
            qf = tl.permute(tl.reshape(qf, (BLOCK_N, BLOCK_K // BLOCKED, BLOCKED // 8, 8)), (0, 1, 3, 2))
        qf = tl.reshape(qf, (BLOCK_N, BLOCK_K // GROUP, GROUP))
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g_mask = row_mask[:, None] & (offs_g[None, :] < K // GROUP)
        s = tl.load(s_ptr + rows[:, None] * (K // GROUP) + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + rows[:, None] * (K // GROUP) + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
        w = qf * s[:, :, None] + mn[:, :, None]
        return tl.reshape(w, (BLOCK_N, BLOCK_K))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(
            w_ptr + rows[:, None] * K + offs_k[None, :], mask=row_mask[:, None] & (offs_k[None, :] < K), other=0.0
        )
        return w.to(tl.float32)


@triton.jit
def _epilogue(
    acc,
    acc_up,
    offs_m,
    m_mask,
    rows,
    row_mask,
    out_ptr,
    stride_om,
    res_ptr,
    stride_rm,
    b_ptr,
    BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    """ACT: 0 none, 1 SwiGLU (silu(acc) * acc_up), 2 GELU (erf form). Rounds like the reference: the
    product to the output dtype first, then the activation, then the residual sum."""
    dt = out_ptr.dtype.element_ty
    if BIAS:
        acc = acc + tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dt).to(tl.float32)
    if ACT == 1:
        up = acc_up.to(dt).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dt).to(tl.float32) * up
    elif ACT == 2:
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    mask = m_mask[:, None] & row_mask[None, :]
    if RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + rows[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y.to(dt).to(tl.float32) + r
    tl.store(out_ptr + offs_m[:, None] * stride_om + rows[None, :], y.to(dt), mask=mask)


@triton.jit
def _matvec_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    out_ptr,
    res_ptr,
    nw_ptr,
    b_ptr,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_om,
    stride_rm,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    NORM: tl.constexpr,
    BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    rstd = tl.zeros((ROWS,), tl.float32)
    if NORM:
        rstd = _row_rstd(x_ptr, stride_xm, offs_m, m_mask, K, eps, BLOCK_K)
    acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
    acc_up = tl.zeros((ROWS, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = _load_x(x_ptr, stride_xm, offs_m, m_mask, offs_k, k_mask, nw_ptr, rstd, NORM).to(tl.float32)
        w = _load_w(w_ptr, s_ptr, m_ptr, rows, row_mask, k0, K, GROUP, INT4, BLOCK_N, BLOCK_K)
        acc += tl.sum(w[None, :, :] * x[:, None, :], axis=2)
        if ACT == 1:
            wu = _load_w(w_ptr, s_ptr, m_ptr, rows + N, row_mask, k0, K, GROUP, INT4, BLOCK_N, BLOCK_K)
            acc_up += tl.sum(wu[None, :, :] * x[:, None, :], axis=2)
    _epilogue(
        acc, acc_up, offs_m, m_mask, rows, row_mask, out_ptr, stride_om, res_ptr, stride_rm, b_ptr, BIAS, ACT, RESIDUAL
    )


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    m_ptr,
    out_ptr,
    N,
    K,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCKED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = rows < N
    w = _load_w(w_ptr, s_ptr, m_ptr, rows, row_mask, k0, K, GROUP, True, BLOCK_N, BLOCK_K, BLOCKED)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = row_mask[:, None] & (offs_k[None, :] < K)
    tl.store(out_ptr + rows[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _blocked_f(words, j: tl.constexpr):
    """Nibble j of each word as the float32 1 + q / 16: shifted to the top of the mantissa under the
    exponent of 1.0, so one shift and one logic op convert it (no int-to-float, no subtraction)."""
    if j < 5:
        shifted = words << (19 - 4 * j)
    else:
        shifted = words >> (4 * j - 19)
    return ((shifted & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _load_blocked_tile(
    w_ptr, s_ptr, m_ptr, rows, row_mask, blk, n_blocks, stride_w, stride_g, GROUP: tl.constexpr, BLOCK: tl.constexpr
):
    """Words [rows, blocks, BLOCK / 8] of the blocks `blk`, and each block's scale and minimum [rows, blocks]."""
    offs_i = tl.arange(0, BLOCK // 8)
    blk_mask = row_mask[:, None] & (blk < n_blocks)[None, :]
    words = tl.load(
        w_ptr + rows[:, None, None] * stride_w + blk[None, :, None] * (BLOCK // 8) + offs_i[None, None, :],
        mask=blk_mask[:, :, None],
        other=0,
    )
    g_idx = rows[:, None] * stride_g + (blk * BLOCK // GROUP)[None, :]
    s = tl.load(s_ptr + g_idx, mask=blk_mask, other=0.0).to(tl.float32)
    mn = tl.load(m_ptr + g_idx, mask=blk_mask, other=0.0).to(tl.float32)
    return words, s, mn


@triton.jit
def _gemv_blocked_int4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    out_ptr,
    res_ptr,
    nw_ptr,
    b_ptr,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_om,
    stride_rm,
    stride_w,
    stride_g,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,
):
    """1..ROWS rows times an INT4 matrix in the blocked layout (quant.BlockedInt4Weight: word i of a
    BLOCK-column block holds column (BLOCK / 8) j + i), so a thread's consecutive words need consecutive x
    values for each nibble j and both load as vectors in the same register layout. Per block (one group):
    sum_k x_k q_k = 16 (sum_k x_k (1 + q_k / 16) - sum_k x_k), then scale and minimum once per block."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    WORDS: tl.constexpr = BLOCK // 8
    offs_i = tl.arange(0, WORDS)
    n_blocks = K // BLOCK
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_B), tl.float32)
    acc_up = tl.zeros((ROWS, BLOCK_N, BLOCK_B), tl.float32)
    sumsq = tl.zeros((ROWS, BLOCK_N, BLOCK_B, WORDS), tl.float32)
    # Weights never depend on earlier kernels: the first tile is fetched before the grid-dependency wait.
    blk = tl.arange(0, BLOCK_B)
    words, s, mn = _load_blocked_tile(
        w_ptr, s_ptr, m_ptr, rows, row_mask, blk, n_blocks, stride_w, stride_g, GROUP, BLOCK
    )
    words_up, s_up, mn_up = words, s, mn
    if ACT == 1:
        words_up, s_up, mn_up = _load_blocked_tile(
            w_ptr, s_ptr, m_ptr, rows + N, row_mask, blk, n_blocks, stride_w, stride_g, GROUP, BLOCK
        )
    _wait_for_previous_kernel(PDL)
    # x (and the norm gain) is read through pointers of the weight tile's full shape [rows, blocks, words]
    # so that it lands in the tile's register layout.
    zero_rows = (rows * 0)[:, None, None]
    for kb in range(0, n_blocks, BLOCK_B):
        blk = kb + tl.arange(0, BLOCK_B)
        x_mask = m_mask[:, None, None, None] & (row_mask[:, None, None] & (blk < n_blocks)[None, :, None])[None]
        cur, cur_s, cur_mn, cur_up, cur_s_up, cur_mn_up = words, s, mn, words_up, s_up, mn_up
        words, s, mn = _load_blocked_tile(
            w_ptr, s_ptr, m_ptr, rows, row_mask, blk + BLOCK_B, n_blocks, stride_w, stride_g, GROUP, BLOCK
        )
        if ACT == 1:
            words_up, s_up, mn_up = _load_blocked_tile(
                w_ptr, s_ptr, m_ptr, rows + N, row_mask, blk + BLOCK_B, n_blocks, stride_w, stride_g, GROUP, BLOCK
            )
        part = tl.zeros((ROWS, BLOCK_N, BLOCK_B, WORDS), tl.float32)
        part_up = tl.zeros((ROWS, BLOCK_N, BLOCK_B, WORDS), tl.float32)
        xsum = tl.zeros((ROWS, BLOCK_N, BLOCK_B, WORDS), tl.float32)
        for j in tl.static_range(8):
            cols = zero_rows + (blk * BLOCK + WORDS * j)[None, :, None] + offs_i[None, None, :]
            xj = tl.load(x_ptr + offs_m[:, None, None, None] * stride_xm + cols[None], mask=x_mask, other=0.0)
            xj = xj.to(tl.float32)
            if NORM:
                sumsq += xj * xj
                g = tl.load(nw_ptr + cols, mask=(blk < n_blocks)[None, :, None], other=0.0)
                xj = xj * g.to(tl.float32)[None]
            xsum += xj
            part += _blocked_f(cur, j)[None] * xj
            if ACT == 1:
                part_up += _blocked_f(cur_up, j)[None] * xj
        xs = tl.sum(xsum, axis=3)
        acc += cur_s[None] * (16.0 * (tl.sum(part, axis=3) - xs)) + cur_mn[None] * xs
        if ACT == 1:
            acc_up += cur_s_up[None] * (16.0 * (tl.sum(part_up, axis=3) - xs)) + cur_mn_up[None] * xs
    y = tl.sum(acc, axis=2)
    y_up = tl.sum(acc_up, axis=2)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(sumsq, axis=3), axis=2) / K + eps)
        y = y * rstd
        y_up = y_up * rstd
    _epilogue(
        y, y_up, offs_m, m_mask, rows, row_mask, out_ptr, stride_om, res_ptr, stride_rm, b_ptr, BIAS, ACT, RESIDUAL
    )


@triton.jit
def _load_code_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, k0, k_end, stride_w, stride_g, GROUP: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
    """Words [rows, BLOCK_K / 8] of columns k0..k0 + BLOCK_K (zeros from k_end on), with their groups' scales
    and minimums [rows, BLOCK_K / GROUP]."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + rows[:, None] * stride_w + offs_w[None, :],
                    mask=row_mask[:, None] & (offs_w < k_end // 8)[None, :], other=0)  # fmt: skip
    offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    g_mask = row_mask[:, None] & (offs_g < k_end // GROUP)[None, :]
    s = tl.load(s_ptr + rows[:, None] * stride_g + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
    mn = tl.load(m_ptr + rows[:, None] * stride_g + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
    return words, s, mn


@triton.jit
def _split_program(N, M, K, k_per_split, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (n, s, m) of a K-split product: its weight rows, x rows (with masks) and K range."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_begin = tl.program_id(1) * k_per_split
    return rows, rows < N, offs_m, offs_m < M, k_begin, tl.minimum(K, k_begin + k_per_split)


@triton.jit
def _dequant_code_tile(words, s, mn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_load_code_tile`'s words as float32 weights [BLOCK_N, BLOCK_K] in the words' nibble order (position
    8 i + j: nibble j of word i)."""
    q = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    codes = tl.reshape((q | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC, (BLOCK_N, BLOCK_K // GROUP, GROUP))
    return tl.reshape(codes * s[:, :, None] + mn[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _dot_into(w, xt, acc, IEEE: tl.constexpr):
    """acc + w @ xt on tensor cores, in full float32 precision when IEEE."""
    if IEEE:
        return tl.dot(w, xt, acc, input_precision="ieee")
    return tl.dot(w, xt, acc)


@triton.jit
def _store_partial(part_ptr, acc, M, N, rows, row_mask, offs_m, m_mask):
    """A program's float32 partial product [weight rows, x rows] into part[split, x rows, weight rows]."""
    part = part_ptr + tl.program_id(1) * M * N + offs_m[None, :] * N + rows[:, None]
    tl.store(part, acc, mask=row_mask[:, None] & m_mask[None, :])


@triton.jit
def _splitk_blocked_int4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    nw_ptr,
    part_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_w,
    stride_g,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """A few rows of x times an INT4 matrix in the blocked layout on tensor cores, split over K: program
    (n, s, m) multiplies weight rows n * BLOCK_N.. with columns s * k_per_split.. and stores its float32
    partial product in part[s, m rows, n rows]; `_splitk_epilogue_kernel` sums the splits. Few rows read
    the whole matrix for little arithmetic, so the split exists to keep enough weight bytes in flight.
    The weight tile is the MMA's tall operand ([BLOCK_N, BLOCK_K] x x^T [BLOCK_K, BLOCK_M]), dequantized in
    registers in the words' nibble order (word i, nibble j) while x is gathered in that same order
    (column (BLOCK / 8) j + i of the block), so no register shuffles are needed. With NORM, x is multiplied
    by the norm gain here and by 1 / rms in the epilogue."""
    rows, row_mask, offs_m, m_mask, k_begin, k_end = _split_program(N, M, K, k_per_split, BLOCK_N, BLOCK_M)
    WORDS: tl.constexpr = BLOCK // 8
    p = tl.arange(0, BLOCK_K)
    word = p // 8
    cols_in_tile = (word // WORDS) * BLOCK + WORDS * (p % 8) + word % WORDS
    dt = x_ptr.dtype.element_ty
    # Weights never depend on earlier kernels: the first tile is fetched before the grid-dependency wait.
    words, s, mn = _load_code_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, k_begin, k_end, stride_w, stride_g, GROUP,
                                   BLOCK_K)  # fmt: skip
    _wait_for_previous_kernel(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        cur, cur_s, cur_mn = words, s, mn
        words, s, mn = _load_code_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, k0 + BLOCK_K, k_end, stride_w, stride_g,
                                       GROUP, BLOCK_K)  # fmt: skip
        cols = k0 + cols_in_tile
        c_mask = cols < k_end
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + cols[:, None], mask=c_mask[:, None] & m_mask[None, :],
                     other=0.0)  # fmt: skip
        if NORM:
            gain = tl.load(nw_ptr + cols, mask=c_mask, other=0.0).to(dt).to(tl.float32)
            xt = (xt.to(tl.float32) * gain[:, None]).to(dt)
        w = _dequant_code_tile(cur, cur_s, cur_mn, GROUP, BLOCK_N, BLOCK_K).to(dt)
        acc = _dot_into(w, xt, acc, IEEE)
    _store_partial(part_ptr, acc, M, N, rows, row_mask, offs_m, m_mask)


@triton.jit
def _splitk_epilogue_kernel(
    x_ptr,
    part_ptr,
    out_ptr,
    res_ptr,
    b_ptr,
    M,
    N,
    K,
    splits,
    eps,
    stride_xm,
    stride_om,
    stride_rm,
    NORM: tl.constexpr,
    BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row m, features pid * BLOCK..: the sum of `_splitk_blocked_int4_kernel`'s partial products (gate and
    up halves for SwiGLU), times 1 / rms(x) with NORM, then bias, activation and residual."""
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    width = 2 * N if ACT == 1 else N
    _wait_for_previous_kernel(PDL)
    acc = tl.zeros((BLOCK,), tl.float32)
    acc_up = tl.zeros((BLOCK,), tl.float32)
    for sp in range(0, splits):
        base = part_ptr + (sp * M + m) * width
        acc += tl.load(base + cols, mask=col_mask, other=0.0)
        if ACT == 1:
            acc_up += tl.load(base + N + cols, mask=col_mask, other=0.0)
    offs_m = m + tl.arange(0, 1)
    if NORM:
        rstd = _row_rstd(x_ptr, stride_xm, offs_m, offs_m < M, K, eps, 1024)
        acc = acc * rstd
        acc_up = acc_up * rstd
    _epilogue(acc[None, :], acc_up[None, :], offs_m, offs_m < M, cols, col_mask, out_ptr, stride_om, res_ptr,
              stride_rm, b_ptr, BIAS, ACT, RESIDUAL)  # fmt: skip
