"""Gluon GEMV for one row times a blocked INT4 matrix that copies its whole weight slice into shared memory
(TMA) before it waits for the previous kernel, so that in the decode chain each GEMV's weight reads overlap
the kernel before it.

Why: the one-row GEMVs of a decode step last a few microseconds and are mostly latency (launch, first loads,
tail), not bandwidth (kernels/gluon_gemv.py under ncu: 18.75 % occupancy, DRAM 15 % busy). Weights never
depend on an earlier kernel, so under programmatic dependent launch a GEMV can start while the previous
kernel still runs, ask the TMA unit for all of its rows (one thread's instructions, no registers), let the
next kernel launch, and only then wait for its input. Each program takes TILES tiles of BN rows times the
whole of K (cuda_ops.staged_plan sizes it so that two programs fit in one SM's shared memory: this one and
the next kernel's). x is normalized once per program into shared memory, in the order the weight words need
it. Arithmetic, weight layout and epilogue as kernels/gluon_gemv.py; CUDA with TMA (Hopper and later) only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton.language as tl

from tinyloop.kernels.gluon_gemv import (
    _jit,
    _load_bias_residual,
    _nibble_as_float,
    _pdl_end,
    _pdl_wait,
    _store_rows,
    gl,
)
from tinyloop.kernels.gluon_hopper import HOPPER_IMPORT_ERROR, fence_async_shared, mbarrier, tma

_IMPORT_ERROR = HOPPER_IMPORT_ERROR

# 64-column blocks per TMA box along K: a box side holds at most 256 elements (32 blocks x 8 words).
CHUNK_BLOCKS = 32
_CHUNK = tl.constexpr(CHUNK_BLOCKS)


# Rows per tile: R rows per thread x WR warps (all along rows); cuda_ops picks (R, WR) with R * WR = 16.
TILE_ROWS = 16
# Shared memory one program may take: two must fit in an SM (227 KiB on Hopper), this kernel's and the next
# kernel's, or the next one cannot start staging while this one computes.
SMEM_BUDGET = 120 * 1024


def available() -> bool:
    return gl is not None and tma is not None and hasattr(tma, "async_copy_global_to_shared")


@dataclass(frozen=True)
class StagedPlan:
    """How one GEMV is cut: `tiles` tiles of TILE_ROWS rows per program, `chunks` TMA boxes of CHUNK_BLOCKS
    64-column blocks along K, `programs` programs, `smem_bytes` of shared memory each."""

    tiles: int
    chunks: int
    programs: int
    smem_bytes: int


@functools.cache  # asked once per launch; a pure function of the shape
def staged_plan(n: int, k: int, act: int, sms: int, scale_bytes: int = 2) -> StagedPlan | None:
    """The cut for an N x K GEMV (2N rows read for SwiGLU, act 1) on `sms` SMs: the fewest tiles per program
    that still give every SM at most one program. None where the kernel does not apply: K not a whole number
    of 64-column blocks whose scales fill 16-byte rows (TMA's stride rule), or more shared memory than
    SMEM_BUDGET (a large vocabulary head)."""
    if n <= 0 or k <= 0 or k % 64 or (k // 64 * scale_bytes) % 16 or sms <= 0:
        return None
    chunks = -(-(k // 64) // CHUNK_BLOCKS)
    total_tiles = -(-n // TILE_ROWS)
    tiles = -(-total_tiles // sms)
    halves = 2 if act == 1 else 1
    weights = halves * tiles * chunks * TILE_ROWS * CHUNK_BLOCKS * (8 * 4 + 2 * scale_bytes)
    x_staged = chunks * CHUNK_BLOCKS * (64 * 4 + 4)
    smem = weights + x_staged + 1024  # + the barrier and the kernel's reduction scratch
    if smem > SMEM_BUDGET:
        return None
    return StagedPlan(tiles, chunks, -(-total_tiles // tiles), smem)


@_jit
def _stage_weights(w_desc, s_desc, m_desc, row0, N, BN: gl.constexpr, TILES: gl.constexpr, KCH: gl.constexpr,
                   HALVES: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
    """Asks the TMA unit for a program's whole weight slice: TILES tiles of BN rows from row0 (and, with
    HALVES 2, the SwiGLU up half N rows further down) x KCH boxes of CHUNK_BLOCKS blocks, box (h TILES + t)
    KCH + c of the returned words / scales / minimums, tile t signalling barrier t. Then the PDL wait: the
    weights never depend on an earlier kernel, so they are all in flight before it. PDL 1 lets the next kernel
    launch after the wait, 2 before it, 3 not here but in `_release`, after this program's stores."""
    BOXES: gl.constexpr = HALVES * TILES * KCH
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [BOXES, BN, _CHUNK, 8], w_desc.layout)
    s_smem = gl.allocate_shared_memory(s_desc.dtype, [BOXES, BN, _CHUNK], s_desc.layout)
    m_smem = gl.allocate_shared_memory(m_desc.dtype, [BOXES, BN, _CHUNK], m_desc.layout)
    # One barrier per tile, so that the first tile's arithmetic starts while later tiles are still arriving.
    bars = gl.allocate_shared_memory(gl.int64, [TILES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(TILES):
        mbarrier.init(bars.index(t), count=1)
    fence_async_shared()
    box_bytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes + m_desc.block_type.nbytes
    for t in gl.static_range(TILES):
        mbarrier.expect(bars.index(t), HALVES * KCH * box_bytes)
        for h in gl.static_range(HALVES):
            for c in gl.static_range(KCH):
                i = (h * TILES + t) * KCH + c
                r = row0 + t * BN + h * N
                tma.async_copy_global_to_shared(w_desc, [r, c * _CHUNK, 0], bars.index(t), w_smem.index(i))
                tma.async_copy_global_to_shared(s_desc, [r, c * _CHUNK], bars.index(t), s_smem.index(i))
                tma.async_copy_global_to_shared(m_desc, [r, c * _CHUNK], bars.index(t), m_smem.index(i))
    _pdl_wait(PDL)  # PDL 2: the next kernel may start now and stage its own weights
    return w_smem, s_smem, m_smem, bars


@_jit
def _release(bars, TILES: gl.constexpr, PDL: gl.constexpr):
    """The tiles' barriers, invalidated at the program's end; with PDL 3 the next kernel may launch now."""
    for t in gl.static_range(TILES):
        mbarrier.invalidate(bars.index(t))
    _pdl_end(PDL)


@_jit
def _gemv_int4_staged_kernel(
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
    magic,
    NORM: gl.constexpr,
    BIAS: gl.constexpr,
    ACT: gl.constexpr,
    RESIDUAL: gl.constexpr,
    TILES: gl.constexpr,
    KCH: gl.constexpr,
    R: gl.constexpr,
    WR: gl.constexpr,
    PDL: gl.constexpr,
):
    """out[n] = act(sum_k norm(x)_k w[n, k]) (+ residual) for one row x; rows pid * TILES * R * WR.. of w.
    w_desc: the words as [rows, blocks, 8] with [R * WR, 32, 8] boxes; s_desc / m_desc: scales and minimums
    as [rows, blocks] with [R * WR, 32] boxes. SwiGLU (ACT 1) reads the up half N rows further down."""
    # A thread holds R rows x 4 words of two 64-column blocks; a warp the 32 blocks (x 2 half-blocks) of a
    # chunk for its rows, so that no sum over blocks crosses warps (no barrier per tile).
    L3: gl.constexpr = gl.BlockedLayout([R, 2, 4], [1, 16, 2], [WR, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [rows, blocks]
    XL: gl.constexpr = gl.SliceLayout(0, L3)  # [blocks, words]
    # Staged x: [nibble j, block, word] so that the words' x for one j are contiguous (no bank conflicts).
    XS: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 16, 2], [WR, 1, 1], [2, 1, 0])
    BN: gl.constexpr = R * WR
    HALVES: gl.constexpr = 2 if ACT == 1 else 1
    row0 = gl.program_id(0) * (TILES * BN)

    w_smem, s_smem, m_smem, bars = _stage_weights(w_desc, s_desc, m_desc, row0, N, BN, TILES, KCH, HALVES, PDL)

    # x (times the norm's gain) and its per-block sums, once per program; the norm's 1 / rms scales y at the end.
    plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    x_smem = gl.allocate_shared_memory(gl.float32, [KCH, 8, _CHUNK, 8], plain3)  # stored a chunk at a time
    x_rows = x_smem._reinterpret(gl.float32, [KCH * 8, _CHUNK, 8], plain2)  # read one (chunk, j) at a time
    xsum_smem = gl.allocate_shared_memory(gl.float32, [KCH, _CHUNK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    nib = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, XS))), 1), 2)
    blk = gl.expand_dims(gl.expand_dims(gl.arange(0, _CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(2, XS))), 0), 2)
    word = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, XS))), 0), 1)
    sumsq = gl.zeros([8, _CHUNK, 8], gl.float32, layout=XS)
    for c in gl.static_range(KCH):
        cols = (c * _CHUNK + blk) * 64 + nib * 8 + word
        xv = gl.load(x_ptr + cols, mask=cols < K, other=0.0).to(gl.float32)
        if NORM:
            sumsq += xv * xv
            xv = xv * gl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(gl.float32)
        x_smem.index(c).store(xv)
        xsum_smem.index(c).store(gl.sum(gl.sum(xv, axis=2), axis=0))
    rstd = 1.0
    if NORM:
        rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(gl.sum(sumsq, axis=2), axis=1), axis=0) / K + eps)
    gl.thread_barrier()

    for t in gl.static_range(TILES):
        rows = row0 + t * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L2))
        # Fetched first, so that their latency hides behind the tile's arithmetic (the residual is the
        # previous kernel's output: it cannot come before the wait).
        bias, res = _load_bias_residual(0, rows, N, 1, b_ptr, res_ptr, 0, BIAS, RESIDUAL)
        mbarrier.wait(bars.index(t), 0)
        acc = gl.zeros([BN, _CHUNK], gl.float32, layout=L2)
        acc_up = gl.zeros([BN, _CHUNK], gl.float32, layout=L2)
        for c in gl.static_range(KCH):
            i = t * KCH + c
            words = w_smem.index(i).load(L3)
            # Bytes 0x80 | q << 3 of the even (lo) and odd (hi) nibbles; >> is arithmetic, the mask drops the sign.
            lo = ((words << 3) & 0x78787878) | -2139062144  # 0x80808080
            hi = ((words >> 1) & 0x78787878) | -2139062144
            lo_up = lo
            hi_up = hi
            if ACT == 1:
                words_up = w_smem.index(i + TILES * KCH).load(L3)
                lo_up = ((words_up << 3) & 0x78787878) | -2139062144
                hi_up = ((words_up >> 1) & 0x78787878) | -2139062144
            part = gl.zeros([BN, _CHUNK, 8], gl.float32, layout=L3)
            part_up = gl.zeros([BN, _CHUNK, 8], gl.float32, layout=L3)
            for j in gl.static_range(8):
                x3 = gl.expand_dims(x_rows.index(c * 8 + j).load(XL), 0)
                part += _nibble_as_float(lo, hi, magic, j) * x3
                if ACT == 1:
                    part_up += _nibble_as_float(lo_up, hi_up, magic, j) * x3
            xs = gl.expand_dims(xsum_smem.index(c).load(gl.SliceLayout(0, L2)), 0)  # [1, blocks]
            s = s_smem.index(i).load(L2).to(gl.float32)
            mn = m_smem.index(i).load(L2).to(gl.float32)
            acc += s * (16.0 * (gl.sum(part, axis=2) - xs)) + mn * xs
            if ACT == 1:
                s_up = s_smem.index(i + TILES * KCH).load(L2).to(gl.float32)
                mn_up = m_smem.index(i + TILES * KCH).load(L2).to(gl.float32)
                acc_up += s_up * (16.0 * (gl.sum(part_up, axis=2) - xs)) + mn_up * xs
        y = gl.sum(acc, axis=1) * rstd
        y_up = gl.sum(acc_up, axis=1) * rstd
        _store_rows(y, y_up, 0, rows, N, 1, out_ptr, 0, bias, res, BIAS, ACT, RESIDUAL)
    _release(bars, TILES, PDL)
