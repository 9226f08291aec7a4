"""Gluon GEMM for tens to hundreds of rows times a blocked INT4 matrix (a short prefill), on Hopper's wgmma.

Why: at 128 rows cuBLAS on the dequantized 16-bit weight streams 4x the bytes of the INT4 words, and Triton's
own pipelined INT4 GEMM (`triton_matmul._gemm_blocked_int4_kernel`) waits on each tile's dequantization before
its MMA (session 10: 2-3x slower than cuBLAS). Here the order is written down: x tiles and weight words arrive
by TMA STAGES steps ahead; each step's 64 columns (one quantization group) are dequantized from shared memory
into registers (q * scale + minimum in float32, rounded to the compute dtype, as `dequantize_int4` does) and
stored into one of two 16-bit tiles, and the step's wgmma runs asynchronously while the next step dequantizes.

out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) (+ residual[m, n]), accumulated in float32 and rounded once,
as cuBLAS's addmm rounds. CUDA with TMA and wgmma (Hopper) only; `available()` says whether the installed
Triton can build it.
"""

from __future__ import annotations

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


def available() -> bool:
    return gl is not None and warpgroup_mma is not None and hasattr(tma, "async_copy_global_to_shared")


def applies(k: int, group_size: int, x_dtype_bytes: int) -> bool:
    """16-bit x, 64-column groups, and K a whole number of groups."""
    return x_dtype_bytes == 2 and group_size == GROUP_SIZE and k > 0 and k % GROUP_SIZE == 0


@_jit
def _issue_step(x_desc, w_desc, x_smem, w_smem, bars, step, slot, row0, col0):
    """TMA for step `step`: x rows row0.. columns 64 step.., and the words of weight rows col0.. for them."""
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [row0, step * GROUP], bar, x_smem.index(slot))
    tma.async_copy_global_to_shared(w_desc, [col0, step * (GROUP // 8)], bar, w_smem.index(slot))


@_jit
def _dequantize(words, s, mn, dt, WL3: gl.constexpr):
    """Words [BN, 8] (word i: column 8 j + i in nibble j) -> the 16-bit weights [BN, 64] in column order."""
    shifts = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL3))) * 4
    w3 = gl.expand_dims(gl.convert_layout(words, gl.SliceLayout(1, WL3)), 1)  # [BN, 1 (j), 8 (i)]
    q = (w3 >> gl.expand_dims(gl.expand_dims(shifts, 0), 2)) & 0xF  # [BN, 8 (j), 8 (i)]
    qf = (q | 0x4B000000).to(gl.float32, bitcast=True) - 8388608.0
    s3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(s, gl.SliceLayout(1, gl.SliceLayout(2, WL3))), 1), 2)
    m3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(mn, gl.SliceLayout(1, gl.SliceLayout(2, WL3))), 1), 2)
    return gl.reshape((qf * s3 + m3).to(dt), [words.shape[0], GROUP])


@_jit
def _step(x_desc, w_desc, x_smem, w_smem, b_smem, bars, acc, s, mn, step, steps, row0, col0, dt: gl.constexpr,
          WL: gl.constexpr, WL3: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One 64-column step: wait for its TMA, dequantize its words into 16-bit tile step % 2, start its wgmma,
    wait for the previous step's (whose x slot and 16-bit tile are then free), and ask for step + STAGES - 1."""
    slot = step % STAGES
    mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
    words = w_smem.index(slot).load(WL)
    b = _dequantize(words, s, mn, dt, WL3)
    # Every warp past its previous step's wgmma wait: with two warpgroups, the other one's wgmma of two steps
    # ago may still read this tile until then.
    gl.thread_barrier()
    b_tile = b_smem.index(step % 2)
    b_tile.store(b)
    fence_async_shared()
    gl.thread_barrier()  # every warp's part of the tile written before the warpgroup's wgmma reads it
    acc = warpgroup_mma(x_smem.index(slot), b_tile.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    ahead = step + STAGES - 1
    if ahead < steps:
        _issue_step(x_desc, w_desc, x_smem, w_smem, bars, ahead, ahead % STAGES, row0, col0)
    return acc


@_jit
def _gemm_int4_kernel(
    x_desc,
    w_desc,
    s_ptr,
    m_ptr,
    out_ptr,
    res_ptr,
    b_ptr,
    M,
    N,
    K,
    stride_om,
    stride_rm,
    BIAS: gl.constexpr,
    RESIDUAL: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Program (n, m): out rows m BM.., columns n BN.. (BM, BN from the descriptors' boxes: x [BM, 64], words
    [BN, 8])."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    dt: gl.constexpr = x_desc.dtype
    col0 = gl.program_id(0) * BN
    row0 = gl.program_id(1) * BM
    steps = K // GROUP
    n_groups = K // GROUP

    x_smem = gl.allocate_shared_memory(dt, [STAGES, BM, GROUP], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, GROUP // 8], w_desc.layout)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, GROUP], dt)
    b_smem = gl.allocate_shared_memory(dt, [2, BN, GROUP], b_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _issue_step(x_desc, w_desc, x_smem, w_smem, bars, i, i, row0, col0)

    # The accumulator: warps along M first (a warpgroup covers 64 rows), then along N.
    WM: gl.constexpr = 4 if BM <= 64 else num_warps
    WN: gl.constexpr = num_warps // WM
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WM, WN], instr_shape=[16, BN // WN, 16]
    )
    acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
    # Dequantization: TPR threads share a weight row, each with 8 / TPR of its words x 8 nibbles ([BN, 8 (j),
    # 8 (i)]), so that no thread repeats another's row when the tile has fewer rows than the program threads.
    TPR: gl.constexpr = 1 if BN >= 32 * num_warps else (32 * num_warps) // BN
    WL3: gl.constexpr = gl.BlockedLayout([1, 8, 8 // TPR], [32 // TPR, 1, TPR], [num_warps, 1, 1], [2, 1, 0])
    WL: gl.constexpr = gl.SliceLayout(1, WL3)  # words [BN, 8]
    SL: gl.constexpr = gl.SliceLayout(1, WL)  # one value per weight row
    rows_n = col0 + gl.arange(0, BN, layout=SL)
    n_mask = rows_n < N
    s_ptrs = s_ptr + rows_n * n_groups
    m_ptrs = m_ptr + rows_n * n_groups
    s = gl.load(s_ptrs, mask=n_mask, other=0.0).to(gl.float32)
    mn = gl.load(m_ptrs, mask=n_mask, other=0.0).to(gl.float32)
    # Step 0 outside the loop: the loop then never hands the final wait a zero-initialized accumulator (ptxas
    # serializes every wgmma of a function where a non-wgmma definition of the accumulator reaches a wait).
    s_next = gl.load(s_ptrs + 1, mask=n_mask & (steps > 1), other=0.0).to(gl.float32)
    m_next = gl.load(m_ptrs + 1, mask=n_mask & (steps > 1), other=0.0).to(gl.float32)
    acc = _step(x_desc, w_desc, x_smem, w_smem, b_smem, bars, acc, s, mn, 0, steps, row0, col0, dt, WL, WL3, STAGES)
    for step in range(1, steps):
        s = s_next
        mn = m_next
        more = n_mask & (step + 1 < steps)  # the next step's scales, fetched while this one computes
        s_next = gl.load(s_ptrs + step + 1, mask=more, other=0.0).to(gl.float32)
        m_next = gl.load(m_ptrs + step + 1, mask=more, other=0.0).to(gl.float32)
        acc = _step(x_desc, w_desc, x_smem, w_smem, b_smem, bars, acc, s, mn, step, steps, row0, col0, dt, WL, WL3,
                    STAGES)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    offs_m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    offs_n = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
    y = acc
    if BIAS:
        y = y + gl.expand_dims(gl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32), 0)
    if RESIDUAL:
        r_ptrs = res_ptr + gl.expand_dims(offs_m, 1) * stride_rm + gl.expand_dims(offs_n, 0)
        y = y + gl.load(r_ptrs, mask=mask, other=0.0).to(gl.float32)
    out_ptrs = out_ptr + gl.expand_dims(offs_m, 1) * stride_om + gl.expand_dims(offs_n, 0)
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
