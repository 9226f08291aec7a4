"""Gluon GEMM for tens to hundreds of rows times a blocked INT4 matrix (a short prefill), on Hopper's wgmma.

Why: at 128 rows cuBLAS on the dequantized 16-bit weight streams 4x the bytes of the INT4 words, and the
prefill dequantizes the body first. Here out^T = W x^T: a program owns BLOCK_N weight rows (the wgmma's M) and
BLOCK_M rows of x (its N). x tiles and the weight's words arrive by TMA STAGES 64-column steps ahead. Each
thread turns two words of a row into eight pairs of 16-bit weights with four instructions a pair: a byte
permute (PRMT) puts the two words' nibbles of one column pair side by side, a LOP3 makes them the 16-bit
floats magic + q (exact), and two packed FMAs give q, then q * scale + minimum rounded once to x's dtype
(float16 scales are exact in float16; for bfloat16 x they are rounded to bfloat16 first, the one difference
from dequantize_int4). The tile goes to shared memory (one of two), and its wgmma runs asynchronously while
the next step dequantizes. (Not from registers: ptxas lets the next step overwrite an in-flight wgmma's
register operand, and an H200 gave wrong products.) SPLIT_K programs may share an output tile: each adds its
K range into a float32 workspace, and the last to arrive (a per-tile counter, reset for the next call)
finishes the tile.

out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) (+ residual[m, n]), accumulated in float32 and rounded once,
as cuBLAS's addmm rounds. CUDA with TMA and wgmma (Hopper) only; `available()` says whether the installed
Triton can build it.
"""

from __future__ import annotations

import triton.language as tl

from tinyloop.kernels.gluon_gemv import _jit, gl
from tinyloop.kernels.gluon_hopper import (
    HOPPER_IMPORT_ERROR,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_IMPORT_ERROR = HOPPER_IMPORT_ERROR

GROUP_SIZE = 64  # columns per step: one quantization group (quant.BlockedInt4Weight's 64-column blocks)
GROUP = gl.constexpr(GROUP_SIZE) if gl is not None else GROUP_SIZE


def _pair_asm(kk: int, odd: int, fp16: bool) -> str:
    """Two words (column 8 j + i of a 64-column step is nibble j of word i; the words here are i = 2 t and
    2 t + 1) -> the 16-bit pair (column 16 kk + 8 odd + 2 t, the next column) as q * scale + minimum.
    $1, $2: the words; $3, $4: scale and minimum, each twice in one register."""
    if fp16:
        magic, one, neg_magic, kind = "0x64006400", "0x3C003C00", "0xE400E400", "f16x2"  # 1024 + q, 1, -1024
    else:
        magic, one, neg_magic, kind = "0x43004300", "0x3F803F80", "0xC300C300", "bf16x2"  # 128 + q, 1, -128
    select = kk | kk << 4 | (4 + kk) << 8 | (4 + kk) << 12  # byte kk of each word to bytes 0-1 / 2-3
    shift = "shr.u32 t, t, 4; " if odd else ""
    return (
        f"{{ .reg .b32 t, q, one, neg; mov.b32 one, {one}; mov.b32 neg, {neg_magic}; "
        f"prmt.b32 t, $1, $2, {select:#06x}; {shift}"
        f"lop3.b32 q, t, 0x000F000F, {magic}, 0xea; "
        f"fma.rn.{kind} q, q, one, neg; fma.rn.{kind} $0, q, $3, $4; }}"
    )


# The eight pairs joined as [row, t, e, odd, kk_lo, kk_hi] (innermost join first), permuted to column order:
# column 32 kk_hi + 16 kk_lo + 8 odd + 2 t + e.
TILE_ORDER = (0, 5, 4, 3, 1, 2)
_TILE_ORDER = tl.constexpr(TILE_ORDER)
_PAIRS_BF16 = tl.constexpr(tuple(_pair_asm(c // 2, c % 2, False) for c in range(8)))
_PAIRS_FP16 = tl.constexpr(tuple(_pair_asm(c // 2, c % 2, True) for c in range(8)))


def available() -> bool:
    return gl is not None and warpgroup_mma is not None and hasattr(tma, "async_copy_global_to_shared")


def applies(k: int, group_size: int, x_dtype_bytes: int) -> bool:
    """16-bit x, 64-column groups, and K a whole number of groups."""
    return x_dtype_bytes == 2 and group_size == GROUP_SIZE and k > 0 and k % GROUP_SIZE == 0


@_jit
def _pair(w3, s3, m3, C: gl.constexpr, FP16: gl.constexpr):
    if FP16:
        pair = gl.inline_asm_elementwise(_PAIRS_FP16[C], "=r,r,r,r,r", [w3, s3, m3], dtype=gl.float16, is_pure=True,
                                         pack=2)  # fmt: skip
    else:
        pair = gl.inline_asm_elementwise(_PAIRS_BF16[C], "=r,r,r,r,r", [w3, s3, m3], dtype=gl.bfloat16, is_pure=True,
                                         pack=2)  # fmt: skip
    return pair


@_jit
def _dequantize(words, s, mn, FP16: gl.constexpr):
    """Words [BN, 4 (t), 2 (word 2 t + e)] and per-row scale / minimum [BN] (x's dtype, the words' row slice) ->
    the 16-bit weights [BN, 64] in column order. Every step but the arithmetic is register renaming."""
    BN: gl.constexpr = words.shape[0]
    s3 = gl.expand_dims(gl.expand_dims(s, 1), 2)
    m3 = gl.expand_dims(gl.expand_dims(mn, 1), 2)
    d = gl.join(
        gl.join(gl.join(_pair(words, s3, m3, 0, FP16), _pair(words, s3, m3, 1, FP16)),
                gl.join(_pair(words, s3, m3, 2, FP16), _pair(words, s3, m3, 3, FP16))),
        gl.join(gl.join(_pair(words, s3, m3, 4, FP16), _pair(words, s3, m3, 5, FP16)),
                gl.join(_pair(words, s3, m3, 6, FP16), _pair(words, s3, m3, 7, FP16))),
    )  # fmt: skip
    return gl.reshape(gl.permute(d, _TILE_ORDER.value), [BN, GROUP])


@_jit
def _issue_step(x_desc, w_desc, x_smem, w_smem, bars, step, slot, row0, col0):
    """TMA for step `step`: x rows row0.. columns 64 step.., and the words of weight rows col0.. for them."""
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [row0, step * GROUP], bar, x_smem.index(slot))
    tma.async_copy_global_to_shared(w_desc, [col0, step * (GROUP // 8)], bar, w_smem.index(slot))


@_jit
def _scales(s_ptrs, m_ptrs, step, mask, dt: gl.constexpr):
    return gl.load(s_ptrs + step, mask=mask, other=0.0).to(dt), gl.load(m_ptrs + step, mask=mask, other=0.0).to(dt)


@_jit
def _step(x_desc, w_desc, x_smem, w_smem, a_smem, bars, acc, s, mn, s_next, m_next, s_ptrs, m_ptrs, n_mask, i,
          first, last, row0, col0, WL: gl.constexpr, WL3: gl.constexpr, STAGES: gl.constexpr,
          FP16: gl.constexpr):  # fmt: skip
    """Step i of this program's range [first, last), its and the next step's scales given: wait for its TMA,
    dequantize its words into 16-bit tile i % 2, start its wgmma, load step i + 2's scales (after the fence,
    which would wait for a load in flight; two steps ahead, since one step did not hide their latency: qkv 18.0
    -> 15.6 us at 128 rows), wait for the previous step's wgmma (whose x slot and tile are then free) and ask
    for step i + STAGES - 1 into that x slot."""
    slot = (i - first) % STAGES
    mbarrier.wait(bars.index(slot), ((i - first) // STAGES) & 1)
    words = w_smem.index(slot).load(WL)
    a = _dequantize(gl.convert_layout(gl.reshape(words, [words.shape[0], 4, 2]), WL3, assert_trivial=True), s, mn,
                    FP16)  # fmt: skip
    # Every warp past its previous step's wgmma wait: a wgmma of two steps ago may still read this tile until
    # then.
    gl.thread_barrier()
    a_tile = a_smem.index(i % 2)
    a_tile.store(a)
    fence_async_shared()
    gl.thread_barrier()  # every warp's rows written before the wgmma reads them
    acc = warpgroup_mma(a_tile, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    s_after, m_after = _scales(s_ptrs, m_ptrs, i + 2, n_mask & (i + 2 < last), a_smem.dtype)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    ahead = i + STAGES - 1
    if ahead < last:
        _issue_step(x_desc, w_desc, x_smem, w_smem, bars, ahead, (ahead - first) % STAGES, row0, col0)
    return acc, s_next, m_next, s_after, m_after


@_jit
def _gemm_int4_kernel(
    x_desc,
    w_desc,
    s_ptr,
    m_ptr,
    out_ptr,
    res_ptr,
    b_ptr,
    ws_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_om,
    stride_rm,
    BIAS: gl.constexpr,
    RESIDUAL: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT_K: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Program (n, m, split): weight rows n BN.. times x rows m BM.. over the split's share of the 64-column
    steps (BM, BN from the descriptors' boxes: x [BM, 64], words [BN, 8])."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    dt: gl.constexpr = x_desc.dtype
    FP16: gl.constexpr = dt == gl.float16
    col0 = gl.program_id(0) * BN
    row0 = gl.program_id(1) * BM
    n_groups = K // GROUP
    per_split = gl.cdiv(n_groups, SPLIT_K)
    first = gl.program_id(2) * per_split
    last = gl.minimum(first + per_split, n_groups)

    x_smem = gl.allocate_shared_memory(dt, [STAGES, BM, GROUP], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, GROUP // 8], w_desc.layout)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, GROUP], dt)
    a_smem = gl.allocate_shared_memory(dt, [2, BN, GROUP], a_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if first + i < last:
            _issue_step(x_desc, w_desc, x_smem, w_smem, bars, first + i, i, row0, col0)

    # Warps along the weight rows first (16 each, so that a warpgroup's wgmma covers 64), the rest along x's rows.
    WM: gl.constexpr = num_warps if num_warps * 16 <= BN else BN // 16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WM, num_warps // WM], instr_shape=[16, BM // (num_warps // WM), 16]
    )
    # Dequantization: lane 4 g + t of warp w holds words 2 t and 2 t + 1 of row 8 w + g (and every 8 * warps
    # rows further).
    WL: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [num_warps, 1], [1, 0])  # words [BN, 8]
    WL3: gl.constexpr = gl.BlockedLayout([1, 1, 2], [8, 4, 1], [num_warps, 1, 1], [2, 1, 0])  # [BN, 4 (t), 2 (e)]
    rows_n = col0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL3)))
    n_mask = rows_n < N
    s_ptrs = s_ptr + rows_n * n_groups
    m_ptrs = m_ptr + rows_n * n_groups

    acc = gl.zeros([BN, BM], gl.float32, layout=acc_layout)
    s, mn = _scales(s_ptrs, m_ptrs, first, n_mask, dt)
    s_next, m_next = _scales(s_ptrs, m_ptrs, first + 1, n_mask & (first + 1 < last), dt)
    # Step `first` outside the loop: the loop then never hands a wait a zero-initialized accumulator (ptxas
    # serializes every wgmma of a function where a non-wgmma definition of the accumulator reaches a wait).
    acc, s, mn, s_next, m_next = _step(x_desc, w_desc, x_smem, w_smem, a_smem, bars, acc, s, mn, s_next, m_next,
                                       s_ptrs, m_ptrs, n_mask, first, first, last, row0, col0, WL, WL3, STAGES,
                                       FP16)  # fmt: skip
    for i in range(first + 1, last):
        acc, s, mn, s_next, m_next = _step(x_desc, w_desc, x_smem, w_smem, a_smem, bars, acc, s, mn, s_next, m_next,
                                           s_ptrs, m_ptrs, n_mask, i, first, last, row0, col0, WL, WL3, STAGES,
                                           FP16)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _epilogue(acc, out_ptr, res_ptr, b_ptr, ws_ptr, count_ptr, row0, col0, M, N, stride_om, stride_rm, BIAS,
              RESIDUAL, SPLIT_K, num_warps)  # fmt: skip


@_jit
def _epilogue(acc, out_ptr, res_ptr, b_ptr, ws_ptr, count_ptr, row0, col0, M, N, stride_om, stride_rm,
              BIAS: gl.constexpr, RESIDUAL: gl.constexpr, SPLIT_K: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """acc [BN weight rows, BM x rows] -> out[m, n] (+ bias) (+ residual), stored along n. With SPLIT_K, each
    program adds its part into the float32 workspace [M, N]; the tile's last program finishes it and zeroes the
    workspace and counter for the next call."""
    BN: gl.constexpr = acc.shape[0]
    BM: gl.constexpr = acc.shape[1]
    TN: gl.constexpr = 32 if BN >= 128 else BN // 4  # threads along n, 4 columns each
    OL: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TN, TN], [num_warps, 1], [1, 0])
    y = gl.convert_layout(gl.permute(acc, [1, 0]), OL)  # [BM, BN]
    offs_m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, OL))
    offs_n = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, OL))
    mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
    if SPLIT_K > 1:
        ws_ptrs = ws_ptr + gl.expand_dims(offs_m, 1) * N + gl.expand_dims(offs_n, 0)
        gl.atomic_add(ws_ptrs, y, mask=mask, sem="relaxed")
        gl.thread_barrier()  # every thread's part added before the tile's counter moves
        tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            y = gl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(ws_ptrs, gl.zeros_like(y), mask=mask)
            gl.store(count_ptr + tile, 0)
            _finish(y, out_ptr, res_ptr, b_ptr, offs_m, offs_n, mask, N, stride_om, stride_rm, BIAS, RESIDUAL)
    else:
        _finish(y, out_ptr, res_ptr, b_ptr, offs_m, offs_n, mask, N, stride_om, stride_rm, BIAS, RESIDUAL)


@_jit
def _finish(y, out_ptr, res_ptr, b_ptr, offs_m, offs_n, mask, N, stride_om, stride_rm, BIAS: gl.constexpr,
            RESIDUAL: gl.constexpr):  # fmt: skip
    if BIAS:
        y = y + gl.expand_dims(gl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32), 0)
    if RESIDUAL:
        r_ptrs = res_ptr + gl.expand_dims(offs_m, 1) * stride_rm + gl.expand_dims(offs_n, 0)
        y = y + gl.load(r_ptrs, mask=mask, other=0.0).to(gl.float32)
    out_ptrs = out_ptr + gl.expand_dims(offs_m, 1) * stride_om + gl.expand_dims(offs_n, 0)
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
