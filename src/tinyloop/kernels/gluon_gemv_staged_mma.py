"""The staged decode GEMV (kernels/gluon_gemv_staged.py) with its arithmetic on tensor cores, for 16-bit x.

Why: the staged GEMV fetches its weights before the PDL wait, so what is left after the wait is arithmetic,
and on CUDA cores that is ~4.5 instructions per weight (Nsight Compute). Here one `lop3` turns two nibbles
into two 16-bit floats (magic + q, exact) that are already a register of an `mma.sync` A operand, and the
products run on tensor cores. ptxas counts ~2.3 instructions per weight; on an H200 the decode chain is slower
with it than with the CUDA-core kernel in every version tried, so cuda_ops.STAGED_MMA_SHAPES is empty.

A vector times a matrix uses one of the mma's 8 columns; the other 7 carry other K blocks instead. Warp w
owns weight rows 2w and 2w + 1 of a 16-row tile; its mma rows are (row 2w + h, block 8g + r) for h < 2,
r < 8, and column c of the B operand is x over block 8g + c, so the products that mean something are
those of mma row (h, r) with column r. Per block, sum_k x_k w_k = s (sum_k x_k (magic + q_k) - magic X) +
m X with X = sum_k x_k (x rounded to 16 bits, as the products see it). Weights arrive in the staged kernel's
TMA boxes (16 rows x 32 blocks, one mbarrier per tile); CUDA with TMA (Hopper and later) only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyloop.kernels.gluon_gemv import _jit, _load_bias_residual, _store_rows, gl
from tinyloop.kernels.gluon_gemv_staged import _release, _stage_weights
from tinyloop.kernels.gluon_hopper import HOPPER_IMPORT_ERROR, MMA_V2_IMPORT_ERROR, mbarrier, mma_v2, tma

_IMPORT_ERROR = HOPPER_IMPORT_ERROR or MMA_V2_IMPORT_ERROR

# 64-column blocks per mma step (the mma's 8 columns); K must be a whole number of steps.
STEP_BLOCKS = 8
WARPS = 8  # two weight rows each: a 16-row tile per program step
_WARPS = tl.constexpr(WARPS)

# One instruction per nibble pair: (word >> 4s) & 0x000F000F | magic gives nibbles s and s + 4 as the 16-bit
# floats magic + q (bf16 0x4300: 128 + q; fp16 0x6400: 1024 + q), exact, one A-operand register.
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


def available() -> bool:
    return gl is not None and mma_v2 is not None and tma is not None and hasattr(tma, "async_copy_global_to_shared")


def applies(n: int, k: int, x_dtype_bytes: int) -> bool:
    """16-bit x, and K a whole number of TMA boxes (8 blocks of 64 columns, whose 16-bit scale rows are
    then 16-byte multiples as TMA's strides require)."""
    return x_dtype_bytes == 2 and n > 0 and k > 0 and k % (64 * STEP_BLOCKS) == 0


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
def _a_operand(words, A_L: gl.constexpr, FP16: gl.constexpr):
    """Words [1, warps, 2 (h), 8 (r), 4 (a), 2 (w)] as the mma A operand [16 warps, 64]: row 16 warp + 8 h + r,
    k = 16 s + 8 w + 2 a + e holds nibble s + 4 e of word 2 a + w, i.e. column 8 (s + 4 e) + 2 a + w of the
    block. Every step is register renaming (the layout conversion is asserted trivial)."""
    d = gl.join(gl.join(_pairs(words, 0, FP16), _pairs(words, 1, FP16)),
                gl.join(_pairs(words, 2, FP16), _pairs(words, 3, FP16)))  # fmt: skip
    # [1, warps, h, r, a, w, e, s_lo, s_hi] -> [1, warps, h, r, s_hi, s_lo, w, a, e]
    d = gl.permute(d, [0, 1, 2, 3, 8, 7, 5, 4, 6])
    return gl.convert_layout(gl.reshape(d, [16 * _WARPS, 64]), A_L, assert_trivial=True)


@_jit
def _step_words(words_view, i, q, WL3: gl.constexpr, WL: gl.constexpr):
    """Box i's words of mma step q (blocks 8q.. of the box) as [1, warps, 2 (h), 8 (r), 4 (a), 2 (w)]."""
    step = words_view.index(i).slice(q, 1, dim=1).load(WL3)  # [16 rows, 1, 64 words]
    return gl.convert_layout(gl.reshape(step, [1, _WARPS, 2, 8, 4, 2]), WL, assert_trivial=True)


@_jit
def _step_rows(view, i, q, SL3: gl.constexpr, ROWS: gl.constexpr):
    """Box i's scales (or minimums) of mma step q per mma row, as a float32 [16 warps, 1] column."""
    step = view.index(i).slice(q, 1, dim=1).load(SL3)  # [16 rows, 1, 8 blocks]
    flat = gl.convert_layout(gl.reshape(step, [16 * _WARPS]), ROWS, assert_trivial=True)
    return gl.expand_dims(flat.to(gl.float32), 1)


@_jit
def _group_operands(words_view, s_view, m_view, x_smem, xsum_smem, t, g, WL3: gl.constexpr, WL: gl.constexpr,
                    SL3: gl.constexpr, ROWS: gl.constexpr, B_L: gl.constexpr, COLS: gl.constexpr, KCH: gl.constexpr,
                    GROUPS: gl.constexpr, TILES: gl.constexpr, ACT: gl.constexpr):  # fmt: skip
    """Step (tile t, group g)'s operands from shared memory: words, scales and minimums (and the SwiGLU up
    half's, else the same again), x as the B operand and its per-block sums."""
    i = t * KCH + g // 4
    words = _step_words(words_view, i, g % 4, WL3, WL)
    s = _step_rows(s_view, i, g % 4, SL3, ROWS)
    mn = _step_rows(m_view, i, g % 4, SL3, ROWS)
    words_up, s_up, mn_up = words, s, mn
    if ACT == 1:
        j = i + TILES * KCH
        words_up = _step_words(words_view, j, g % 4, WL3, WL)
        s_up = _step_rows(s_view, j, g % 4, SL3, ROWS)
        mn_up = _step_rows(m_view, j, g % 4, SL3, ROWS)
    xb = x_smem.index(g).permute([1, 0]).load(B_L)
    xs = gl.expand_dims(xsum_smem.index(g).load(COLS), 0)
    return words, s, mn, words_up, s_up, mn_up, xb, xs


@_jit
def _b_column(k):
    """The block column whose x sits in row k of the B operand: the A operand's column k (see _a_operand)."""
    return 8 * (k // 16 + 4 * (k % 2)) + 2 * ((k // 2) % 4) + (k // 8) % 2


@_jit
def _gemv_int4_staged_mma_kernel(
    x_ptr,
    w_desc,
    s_desc,
    m_desc,
    out_ptr,
    res_ptr,
    nw_ptr,
    b_ptr,
    N,
    K,
    eps,
    NORM: gl.constexpr,
    BIAS: gl.constexpr,
    ACT: gl.constexpr,
    RESIDUAL: gl.constexpr,
    TILES: gl.constexpr,
    KCH: gl.constexpr,
    GROUPS: gl.constexpr,
    FP16: gl.constexpr,
    PDL: gl.constexpr,
):
    """out[n] = act(sum_k norm(x)_k w[n, k]) (+ residual) for one 16-bit row x; rows pid * TILES * 16.. of w.
    w_desc: the words as [rows, blocks, 8] with [16, 32, 8] boxes; s_desc / m_desc: scales and minimums as
    [rows, blocks] with [16, 32] boxes (as the CUDA-core staged kernel's: big boxes, few TMA requests); KCH
    boxes per tile row, GROUPS = K / 512 mma steps of 8 blocks. SwiGLU (ACT 1) reads the up half N rows
    further down."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[_WARPS, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # [1, warp, h, r, a, w]: lane (r, a) of warp `warp` holds words 2a, 2a + 1 of block r for rows 2 warp + h.
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 2, 1, 1, 2], [1, 1, 1, 8, 4, 1], [1, _WARPS, 1, 1, 1, 1],
                                        [5, 4, 3, 2, 1, 0])  # fmt: skip
    ROWS: gl.constexpr = gl.SliceLayout(1, mma)
    # One step's slice of a box, [16 rows (2 warp + h), 1, 64 words (8 r + 2 a + w)], held as WL holds it, and
    # its scales [16 rows, 1, 8 blocks r], held where mma row 16 warp + 8 h + r is (lanes 4 r + t).
    WL3: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [1, 0, 0]], lane_bases=[[0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
        warp_bases=[[2, 0, 0], [4, 0, 0], [8, 0, 0]], block_bases=[], shape=[16, 1, 64],
    )  # fmt: skip
    SL3: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0, 0]], lane_bases=[[0, 0, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=[[2, 0, 0], [4, 0, 0], [8, 0, 0]], block_bases=[], shape=[16, 1, 8],
    )  # fmt: skip
    COLS: gl.constexpr = gl.SliceLayout(0, mma)
    HALVES: gl.constexpr = 2 if ACT == 1 else 1
    BOXES: gl.constexpr = HALVES * TILES * KCH
    MAGIC: gl.constexpr = 1024.0 if FP16 else 128.0
    dt = x_ptr.dtype.element_ty
    row0 = gl.program_id(0) * (TILES * 16)

    w_smem, s_smem, m_smem, bars = _stage_weights(w_desc, s_desc, m_desc, row0, N, 16, TILES, KCH, HALVES, PDL)

    # x (times the norm's gain), rounded to 16 bits, in the B operand's order, and its per-block sums, once
    # per program, all groups in one batch of loads: x_smem[g, c, k] = x[(8 g + c) 64 + column(k)], column(k)
    # the A operand's (see _a_operand).
    GP: gl.constexpr = triton.next_power_of_2(GROUPS)
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 1, 32], [1, _WARPS, 1], [2, 1, 0])  # [g, c, k]
    # (Shared layouts have the rank of one element of the buffers, which are indexed along their first dim.)
    plain1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    x_flat = gl.allocate_shared_memory(dt, [GP * 8, 64], plain2)
    xsum_flat = gl.allocate_shared_memory(gl.float32, [GP * 8], plain1)
    i_g = gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL)))
    i_c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
    i_k = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
    col = _b_column(i_k)
    gc = gl.expand_dims(gl.expand_dims(i_g * 512, 1) + gl.expand_dims(i_c * 64, 0), 2)
    x_cols = gc + gl.expand_dims(gl.expand_dims(col, 0), 1)
    x_mask = x_cols < K
    xv = gl.load(x_ptr + x_cols, mask=x_mask, other=0.0).to(gl.float32)
    rstd = 1.0
    if NORM:
        gain = gl.load(nw_ptr + x_cols, mask=x_mask, other=0.0).to(gl.float32)  # issued before the sum's barrier
        rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(gl.sum(xv * xv, axis=2), axis=1), axis=0) / K + eps)
        xv = xv * gain
    xr = xv.to(dt)
    x_flat.store(gl.reshape(xr, [GP * 8, 64]))
    xsum_flat.store(gl.reshape(gl.sum(xr.to(gl.float32), axis=2), [GP * 8]))
    x_smem = x_flat._reinterpret(dt, [GP, 8, 64], plain2)
    xsum_smem = xsum_flat._reinterpret(gl.float32, [GP, 8], plain1)
    gl.thread_barrier()

    # A box [16 rows, 32 blocks, 8 words] seen as [warp, h, group q, block r, a, w]; step q's words are
    # [warp, h, r, a, w] (lane (r, a) reads 32 contiguous bytes of a row: no bank conflicts).
    plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    words_view = w_smem._reinterpret(gl.int32, [BOXES, 16, 4, 64], plain3)
    s_view = s_smem._reinterpret(s_desc.dtype, [BOXES, 16, 4, 8], plain3)
    m_view = m_smem._reinterpret(m_desc.dtype, [BOXES, 16, 4, 8], plain3)
    rho = gl.arange(0, 16 * _WARPS, layout=ROWS)
    keep = gl.expand_dims(rho % 8, 1) == gl.expand_dims(gl.arange(0, 8, layout=COLS), 0)
    zero = gl.zeros([16 * _WARPS, 8], gl.float32, layout=mma)
    # A tile's rows [warps, 2] -> row 2 warp + h, for the bias, residual and store.
    RL: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [1, _WARPS], [1, 0])
    tile_rows = gl.expand_dims(gl.arange(0, _WARPS, layout=gl.SliceLayout(1, RL)) * 2, 1) + gl.expand_dims(
        gl.arange(0, 2, layout=gl.SliceLayout(0, RL)), 0
    )
    # One flat loop over steps of PAIR groups of a tile, each step's shared-memory operands loaded one step
    # ahead, so that their latency hides behind the previous step's arithmetic, and the PAIR groups' mma chains
    # independent of each other. Nsight Compute, with the loads next to their uses and one group per step:
    # 12 cycles per instruction at two warps per scheduler, every warp waiting on a load or on its own mma.
    PAIR: gl.constexpr = 2 if GROUPS % 2 == 0 else 1
    SPT: gl.constexpr = GROUPS // PAIR
    STEPS: gl.constexpr = TILES * SPT
    mbarrier.wait(bars.index(0), 0)
    nxt = _group_operands(words_view, s_view, m_view, x_smem, xsum_smem, 0, 0, WL3, WL, SL3, ROWS, B_L, COLS,
                          KCH, GROUPS, TILES, ACT)  # fmt: skip
    nxt2 = nxt
    if PAIR == 2:
        nxt2 = _group_operands(words_view, s_view, m_view, x_smem, xsum_smem, 0, 1, WL3, WL, SL3, ROWS, B_L, COLS,
                               KCH, GROUPS, TILES, ACT)  # fmt: skip
    rows = row0 + tile_rows
    bias, res = _load_bias_residual(rows, N, b_ptr, res_ptr, BIAS, RESIDUAL)
    y = zero
    y_up = zero
    for step in gl.static_range(STEPS):
        words, s, mn, words_up, s_up, mn_up, xb, xs = nxt
        words2, s2, mn2, words_up2, s_up2, mn_up2, xb2, xs2 = nxt2
        if step + 1 < STEPS:
            if (step + 1) % SPT == 0:
                mbarrier.wait(bars.index((step + 1) // SPT), 0)
            nxt = _group_operands(words_view, s_view, m_view, x_smem, xsum_smem, (step + 1) // SPT,
                                  PAIR * ((step + 1) % SPT), WL3, WL, SL3, ROWS, B_L, COLS, KCH, GROUPS, TILES,
                                  ACT)  # fmt: skip
            if PAIR == 2:
                nxt2 = _group_operands(words_view, s_view, m_view, x_smem, xsum_smem, (step + 1) // SPT,
                                       2 * ((step + 1) % SPT) + 1, WL3, WL, SL3, ROWS, B_L, COLS, KCH, GROUPS, TILES,
                                       ACT)  # fmt: skip
        prod = mma_v2(_a_operand(words, A_L, FP16), xb, zero)
        prod2 = prod
        if PAIR == 2:
            prod2 = mma_v2(_a_operand(words2, A_L, FP16), xb2, zero)
        if ACT == 1:
            prod_up = mma_v2(_a_operand(words_up, A_L, FP16), xb, zero)
            prod_up2 = prod_up
            if PAIR == 2:
                prod_up2 = mma_v2(_a_operand(words_up2, A_L, FP16), xb2, zero)
        y += s * prod + (mn - s * MAGIC) * xs
        if PAIR == 2:
            y += s2 * prod2 + (mn2 - s2 * MAGIC) * xs2
        if ACT == 1:
            y_up += s_up * prod_up + (mn_up - s_up * MAGIC) * xs
            if PAIR == 2:
                y_up += s_up2 * prod_up2 + (mn_up2 - s_up2 * MAGIC) * xs2
        if step % SPT == SPT - 1:
            # Keep mma row (h, r)'s column r, then add up the blocks: [warps, 2 (h), 8 (r), 8 (c)] -> [warps, 2].
            out = gl.sum(gl.sum(gl.reshape(gl.where(keep, y, 0.0), [_WARPS, 2, 8, 8]), axis=3), axis=2) * rstd
            out_up = out
            if ACT == 1:
                out_up = gl.sum(gl.sum(gl.reshape(gl.where(keep, y_up, 0.0), [_WARPS, 2, 8, 8]), axis=3), axis=2)
                out_up = out_up * rstd
            _store_rows(gl.convert_layout(out, RL), gl.convert_layout(out_up, RL), rows, N, out_ptr, bias, res,
                        BIAS, ACT, RESIDUAL)  # fmt: skip
            if step + 1 < STEPS:
                rows = row0 + ((step + 1) // SPT) * 16 + tile_rows
                bias, res = _load_bias_residual(rows, N, b_ptr, res_ptr, BIAS, RESIDUAL)
                y = zero
                y_up = zero
    _release(bars, TILES, PDL)
