"""Gluon (Triton's explicit-layout dialect) GEMV for one row times a blocked INT4 matrix: the decode hot path.

Why Gluon: in plain Triton a weight tile and the x it multiplies each get the register layout the compiler
infers from their own loads, so x ends up loaded, converted and summed once per weight row
(`triton_matmul._gemv_blocked_int4_kernel`; 8.5-12.7 instructions per weight on sm_90). Here the layout is
written down: each thread holds R rows x 4 consecutive words of one 64-column block, and x lives in the
slice of that layout without the row dimension, so a thread loads, converts, scales (norm gain) and sums each
x value once for its R rows. Nibbles become floats with one byte permute (PRMT) per weight instead of a
shift, a mask and an OR.

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
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    gluon = None
    gl = None
    mma_v2 = None
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
    magic,
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
    """out[n] = act(sum_k norm(x)_k w[n, k]) (+ residual) for one row x; rows pid * R * WR.. of w."""
    L3: gl.constexpr = gl.BlockedLayout([R, BPT, 4], [LR, 16 // LR, 2], [WR, WB, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [rows, blocks]
    XL: gl.constexpr = gl.SliceLayout(0, L3)  # [blocks, words]: x, shared by a thread's rows
    BN: gl.constexpr = R * LR * WR
    BB: gl.constexpr = BPT * (16 // LR) * WB
    n_blocks = K // 64

    rows = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L2))
    rows2 = gl.expand_dims(rows, 1)
    row_mask2 = rows2 < N
    rows3 = gl.expand_dims(rows2, 2)
    row_mask3 = rows3 < N
    blk2 = gl.expand_dims(gl.arange(0, BB, layout=gl.SliceLayout(0, L2)), 0)
    words3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, XL)), 0), 0)
    blk3 = gl.expand_dims(blk2, 2) + words3 * 0
    x_blk = gl.expand_dims(gl.arange(0, BB, layout=gl.SliceLayout(1, XL)), 1)
    x_word = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, XL)), 0)

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
    # Weights never depend on earlier kernels: the first tile is fetched before the grid-dependency wait.
    if PDL == 2:  # as triton_pdl._wait_for_previous_kernel
        _launch_dependents()
        _wait_for_previous_kernel()
    elif PDL:
        _wait_for_previous_kernel()
        _launch_dependents()

    acc = gl.zeros([BN, BB], gl.float32, layout=L2)
    acc_up = gl.zeros([BN, BB], gl.float32, layout=L2)
    sumsq = gl.zeros([BB, 8], gl.float32, layout=XL)
    for kb in range(0, n_blocks, BB):
        cur, cur_s, cur_mn, cur_up, cur_s_up, cur_mn_up = words, s, mn, words_up, s_up, mn_up
        more = kb + BB < n_blocks
        words, s, mn = _load_tile(w_tile, g_tile, s_ptr, m_ptr, kb + BB, blk3, blk2, row_mask3, row_mask2, n_blocks,
                                  more, EVEN)  # fmt: skip
        if ACT == 1:
            words_up, s_up, mn_up = _load_tile(w_tile + up_w, g_tile + up_g, s_ptr, m_ptr, kb + BB, blk3, blk2,
                                               row_mask3, row_mask2, n_blocks, more, EVEN)  # fmt: skip
        # Bytes 0x80 | q << 3 of the even (lo) and odd (hi) nibbles; >> is arithmetic, the mask drops the sign.
        lo = ((cur << 3) & 0x78787878) | -2139062144  # 0x80808080
        hi = ((cur >> 1) & 0x78787878) | -2139062144
        lo_up = lo
        hi_up = hi
        if ACT == 1:
            lo_up = ((cur_up << 3) & 0x78787878) | -2139062144
            hi_up = ((cur_up >> 1) & 0x78787878) | -2139062144
        x_cols = (kb + x_blk) * 64 + x_word
        x_mask = (kb + x_blk) < n_blocks
        part = gl.zeros([BN, BB, 8], gl.float32, layout=L3)
        part_up = gl.zeros([BN, BB, 8], gl.float32, layout=L3)
        xsum = gl.zeros([BB, 8], gl.float32, layout=XL)
        for j in gl.static_range(8):
            if EVEN:
                xj = gl.load(x_ptr + x_cols + 8 * j).to(gl.float32)
            else:
                xj = gl.load(x_ptr + x_cols + 8 * j, mask=x_mask, other=0.0).to(gl.float32)
            if NORM:
                sumsq += xj * xj
                if EVEN:
                    xj = xj * gl.load(nw_ptr + x_cols + 8 * j).to(gl.float32)
                else:
                    xj = xj * gl.load(nw_ptr + x_cols + 8 * j, mask=x_mask, other=0.0).to(gl.float32)
            xsum += xj
            x3 = gl.expand_dims(xj, 0)
            part += _nibble_as_float(lo, hi, magic, j) * x3
            if ACT == 1:
                part_up += _nibble_as_float(lo_up, hi_up, magic, j) * x3
        xs = gl.sum(gl.expand_dims(xsum, 0), axis=2)  # [1, blocks]
        acc += cur_s * (16.0 * (gl.sum(part, axis=2) - xs)) + cur_mn * xs
        if ACT == 1:
            acc_up += cur_s_up * (16.0 * (gl.sum(part_up, axis=2) - xs)) + cur_mn_up * xs

    y = gl.sum(acc, axis=1)
    y_up = gl.sum(acc_up, axis=1)
    if NORM:
        rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(sumsq, axis=1), axis=0) / K + eps)
        y = y * rstd
        y_up = y_up * rstd
    row_mask = rows < N
    dt = out_ptr.dtype.element_ty
    if BIAS:
        y = y + gl.load(b_ptr + rows, mask=row_mask, other=0.0).to(gl.float32)
    y = y.to(dt).to(gl.float32)
    if ACT == 1:
        up = y_up.to(dt).to(gl.float32)
        y = (y / (1.0 + gl.exp(-y))).to(dt).to(gl.float32) * up
    elif ACT == 2:
        y = 0.5 * y * (1.0 + gl.erf(y * 0.7071067811865476))
    if RESIDUAL:
        y = y.to(dt).to(gl.float32) + gl.load(res_ptr + rows, mask=row_mask, other=0.0).to(gl.float32)
    gl.store(out_ptr + rows, y.to(dt), mask=row_mask)


# ---- tensor-core variant (16-bit x) ----------------------------------------------------------------------
# One instruction per nibble pair: (word >> 4s) & 0x000F000F | magic gives nibbles s and s + 4 as the 16-bit
# floats magic + q (bf16 0x4300: 128 + q; fp16 0x6400: 1024 + q), exact, already a register of two mma.sync
# A-operand elements.
_PAIR_BF16 = tl.constexpr(
    tuple(
        f"{{ .reg .b32 t; shr.u32 t, $1, {4 * s}; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea; }}"
        if s
        else "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xea;"
        for s in range(4)
    )
)
_PAIR_FP16 = tl.constexpr(
    tuple(
        f"{{ .reg .b32 t; shr.u32 t, $1, {4 * s}; lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xea; }}"
        if s
        else "lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xea;"
        for s in range(4)
    )
)


@_jit
def _pairs(words, S: gl.constexpr, FP16: gl.constexpr):
    """[..., 2] 16-bit floats magic + nibble S, magic + nibble S + 4 of each word (two copies joined)."""
    both = gl.join(words, words)
    if FP16:
        pairs = gl.inline_asm_elementwise(_PAIR_FP16[S], "=r,r,r", [both], dtype=gl.float16, is_pure=True, pack=2)
    else:
        pairs = gl.inline_asm_elementwise(_PAIR_BF16[S], "=r,r,r", [both], dtype=gl.bfloat16, is_pure=True, pack=2)
    return pairs


@_jit
def _a_operand(words, MT: gl.constexpr, RANGES: gl.constexpr, A_L: gl.constexpr, FP16: gl.constexpr):
    """Words [MT, RANGES, 2 (h), 8 (lane row), 4 (a), 2 (w)] as the mma A operand [MT * RANGES * 16, 64]:
    row rep * 16 RANGES + range * 16 + 8 h + lane row, k = 16 s + 8 w + 2 a + e holds nibble s + 4 e of word
    2 a + w, i.e. column 8 (s + 4 e) + 2 a + w of the block. Every step is register renaming."""
    d = gl.join(gl.join(_pairs(words, 0, FP16), _pairs(words, 1, FP16)),
                gl.join(_pairs(words, 2, FP16), _pairs(words, 3, FP16)))  # fmt: skip
    # [MT, R, h, lr, a, w, e, s_lo, s_hi] -> [MT, R, h, lr, s_hi, s_lo, w, a, e]
    d = gl.permute(d, [0, 1, 2, 3, 8, 7, 5, 4, 6])
    return gl.convert_layout(gl.reshape(d, [MT * RANGES * 16, 64]), A_L, assert_trivial=True)


@_jit
def _gemv_int4_mma_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    out_ptr,
    res_ptr,
    nw_ptr,
    b_ptr,
    N,
    eps,
    stride_w,
    stride_g,
    K: gl.constexpr,
    NORM: gl.constexpr,
    BIAS: gl.constexpr,
    ACT: gl.constexpr,
    RESIDUAL: gl.constexpr,
    MT: gl.constexpr,
    RANGES: gl.constexpr,
    FP16: gl.constexpr,
    PDL: gl.constexpr,
):
    """out[n] = act(sum_k norm(x)_k w[n, k]) (+ residual) for one 16-bit row x on tensor cores (mma.sync
    m16n8k16, float32 accumulation). A program owns 16 MT weight rows; its RANGES warps each take one
    contiguous range of K's 64-column groups, and the mma's N dimension (8 wide, of which a vector-times-
    matrix uses one) carries the ranges: column n of the B operand is x over range n, so warp w's products
    with column w are its partial sums, added across warps at the end. Per group: sum_k x_k q_k =
    acc - magic sum_k x_k, the second term from an mma with an all-magic A."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[RANGES, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # [MT, RANGES, h, lane row, a, w]: a thread holds rows lr and lr + 8 of each 16-row tile, words 2a, 2a+1.
    WL: gl.constexpr = gl.BlockedLayout([MT, 1, 2, 1, 1, 2], [1, 1, 1, 8, 4, 1], [1, RANGES, 1, 1, 1, 1],
                                        [5, 4, 3, 2, 1, 0])  # fmt: skip
    BM: gl.constexpr = 16 * MT
    GPR: gl.constexpr = K // 64 // RANGES  # groups per range
    MAGIC: gl.constexpr = 1024.0 if FP16 else 128.0
    dt = x_ptr.dtype.element_ty
    m0 = gl.program_id(0) * BM

    # Word pointers at group 0 of each warp's range: [MT, R, 2, 8, 4, 2] built from 1-D aranges.
    L5: gl.constexpr = gl.SliceLayout(5, WL)
    L4: gl.constexpr = gl.SliceLayout(4, L5)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    i_mt = gl.arange(0, MT, layout=gl.SliceLayout(1, L2))
    i_r = gl.arange(0, RANGES, layout=gl.SliceLayout(0, L2))
    i_h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))
    i_lr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L4))))
    i_a = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L5)))))
    i_w = gl.arange(
        0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, WL)))))
    )
    row2 = gl.expand_dims(i_mt * 16, 1) + gl.expand_dims(i_r * 0, 0)  # [MT, R]
    grp2 = gl.expand_dims(i_mt * 0, 1) + gl.expand_dims(i_r * GPR, 0)
    row3 = gl.expand_dims(row2, 2) + gl.expand_dims(gl.expand_dims(i_h * 8, 0), 0)
    grp3 = gl.expand_dims(grp2, 2) + gl.expand_dims(gl.expand_dims(i_h * 0, 0), 0)
    row4 = gl.expand_dims(row3, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(i_lr, 0), 0), 0)
    grp4 = gl.expand_dims(grp3, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(i_lr * 0, 0), 0), 0)
    word5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i_a * 2, 0), 0), 0), 0)
    off5 = gl.expand_dims((m0 + row4) * stride_w + grp4 * 8, 4) + word5
    word6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i_w, 0), 0), 0), 0), 0)
    w_tile = w_ptr + gl.expand_dims(off5, 5) + word6
    up_w = N * stride_w

    # Rows and groups in the accumulator's layout, for scales and minimums: [16 MT R, 8].
    rho = gl.arange(0, BM * RANGES, layout=gl.SliceLayout(1, mma))
    acc_row = m0 + (rho // (16 * RANGES)) * 16 + rho % 16
    acc_grp = ((rho // 16) % RANGES) * GPR
    g_off = acc_row * stride_g + acc_grp
    up_g = N * stride_g

    words = gl.load(w_tile)
    s = gl.load(s_ptr + g_off).to(gl.float32)
    mn = gl.load(m_ptr + g_off).to(gl.float32)
    words_up, s_up, mn_up = words, s, mn
    if ACT == 1:
        words_up = gl.load(w_tile + up_w)
        s_up = gl.load(s_ptr + g_off + up_g).to(gl.float32)
        mn_up = gl.load(m_ptr + g_off + up_g).to(gl.float32)
    # Weights never depend on earlier kernels: the first groups are fetched before the grid-dependency wait.
    if PDL == 2:
        _launch_dependents()
        _wait_for_previous_kernel()
    elif PDL:
        _wait_for_previous_kernel()
        _launch_dependents()

    # x (times the norm gain), rounded to 16 bits, in every step's B-operand order, once per program, in
    # shared memory: x_smem[t, n, k] = x[(n GPR + t) 64 + column(k)] for ranges n (zero beyond), column(k) =
    # 8 (k // 16 + 4 (k % 2)) + 2 ((k // 2) % 4) + (k // 8) % 2, the A operand's column order.
    XL2: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [RANGES, 1], [1, 0])  # [n, k]
    i_n = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, XL2)), 1)
    i_k = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, XL2)), 0)
    x_cols = i_n * (GPR * 64) + 8 * (i_k // 16 + 4 * (i_k % 2)) + 2 * ((i_k // 2) % 4) + (i_k // 8) % 2
    x_mask = (i_n < RANGES) & (i_k < 64)
    x_smem = gl.allocate_shared_memory(dt, [GPR, 8, 64], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    sumsq = gl.zeros([8, 64], gl.float32, layout=XL2)
    for t in range(GPR):
        xv = gl.load(x_ptr + x_cols + t * 64, mask=x_mask, other=0.0).to(gl.float32)
        if NORM:
            sumsq += xv * xv
            xv = xv * gl.load(nw_ptr + x_cols + t * 64, mask=x_mask, other=0.0).to(gl.float32)
        x_smem.index(t).store(xv.to(dt))
    rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(sumsq, axis=1), axis=0) / K + eps)
    gl.thread_barrier()

    magic_a = gl.full([BM * RANGES, 64], MAGIC, dt, layout=A_L)
    zero = gl.zeros([BM * RANGES, 8], gl.float32, layout=mma)
    y = gl.zeros([BM * RANGES, 8], gl.float32, layout=mma)
    y_up = gl.zeros([BM * RANGES, 8], gl.float32, layout=mma)
    for t in range(GPR):
        cur, cur_s, cur_mn, cur_up, cur_s_up, cur_mn_up = words, s, mn, words_up, s_up, mn_up
        if t + 1 < GPR:
            words = gl.load(w_tile + (t + 1) * 8)
            s = gl.load(s_ptr + g_off + (t + 1)).to(gl.float32)
            mn = gl.load(m_ptr + g_off + (t + 1)).to(gl.float32)
            if ACT == 1:
                words_up = gl.load(w_tile + up_w + (t + 1) * 8)
                s_up = gl.load(s_ptr + g_off + up_g + (t + 1)).to(gl.float32)
                mn_up = gl.load(m_ptr + g_off + up_g + (t + 1)).to(gl.float32)
        xb = x_smem.index(t).permute([1, 0]).load(B_L)
        offset = mma_v2(magic_a, xb, zero)  # magic * sum of x over each range's group, in every row
        prod = mma_v2(_a_operand(cur, MT, RANGES, A_L, FP16), xb, zero)
        y += gl.expand_dims(cur_s, 1) * (prod - offset) + gl.expand_dims(cur_mn / MAGIC, 1) * offset
        if ACT == 1:
            prod_up = mma_v2(_a_operand(cur_up, MT, RANGES, A_L, FP16), xb, zero)
            y_up += gl.expand_dims(cur_s_up, 1) * (prod_up - offset) + gl.expand_dims(cur_mn_up / MAGIC, 1) * offset

    # Warp w's partial sums are column w of its rows: keep those, add over the warps.
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    keep = gl.expand_dims((rho // 16) % RANGES, 1) == gl.expand_dims(cols, 0)
    yr = gl.sum(gl.reshape(gl.where(keep, y, 0.0), [MT, RANGES, 16, 8]), axis=3)
    out = gl.sum(yr, axis=1)  # [MT, 16]
    out_up = out
    if ACT == 1:
        out_up = gl.sum(gl.sum(gl.reshape(gl.where(keep, y_up, 0.0), [MT, RANGES, 16, 8]), axis=3), axis=1)
    if NORM:
        out = out * rstd
        out_up = out_up * rstd
    OL: gl.constexpr = out.type.layout
    rows = (
        m0
        + gl.expand_dims(gl.arange(0, MT, layout=gl.SliceLayout(1, OL)) * 16, 1)
        + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, OL)), 0)
    )
    row_mask = rows < N
    odt = out_ptr.dtype.element_ty
    if BIAS:
        out = out + gl.load(b_ptr + rows, mask=row_mask, other=0.0).to(gl.float32)
    out = out.to(odt).to(gl.float32)
    if ACT == 1:
        up = out_up.to(odt).to(gl.float32)
        out = (out / (1.0 + gl.exp(-out))).to(odt).to(gl.float32) * up
    elif ACT == 2:
        out = 0.5 * out * (1.0 + gl.erf(out * 0.7071067811865476))
    if RESIDUAL:
        out = out.to(odt).to(gl.float32) + gl.load(res_ptr + rows, mask=row_mask, other=0.0).to(gl.float32)
    gl.store(out_ptr + rows, out.to(odt), mask=row_mask)
