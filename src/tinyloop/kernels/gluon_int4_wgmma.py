"""Gluon product of 8-32 rows of x times an INT4 matrix on Hopper's warpgroup tensor cores (wgmma), for batched
decode steps.

Why: kernels/gluon_int4_mma.py gives each warp its own register copy of the x tile (the operand of every warp's
mma.sync), so its instructions grow with the row count: at 32 rows a seed-407m product issues 0.30-0.80 warp
instructions per weight byte (sm_90a, bench/int4_mma_sass.py) against ~0.31 that streaming at the memory's rate
allows. Here x is staged once per program in shared memory, where the tensor cores read it for every warp (wgmma's
B operand), and the decoded weights stay in registers as its A operand, so a program's instructions per K step
are the weight decoding, x's staging and one wgmma per 16 columns, nearly flat in the row count (0.19-0.30 at 32
rows). `KernelPolicy.mma_int4_uses_wgmma` says which products take it.

How the layouts line up: wgmma takes A from registers as pairs of consecutive K positions (k_width 2): a thread
holds K = 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of each 16 (t = its lane % 4). The kernel relabels K so that those are
the columns of the words the thread loads (`_in_wgmma_k_order`: a word's 8 columns become K pairs 0, 8 and 16
apart), and stores x in shared memory in the same K order. Weights, scales, decoding and the split-K finish are
gluon_int4_mma's (`quant.CudaMmaInt4Weight`, one launch per product). CUDA only; sm_90.
"""

from __future__ import annotations

import functools
from typing import Any

from tinyloop.kernels import gluon_int4_mma
from tinyloop.kernels.gluon_hopper import HOPPER_IMPORT_ERROR, fence_async_shared, warpgroup_mma
from tinyloop.kernels.gluon_int4_mma import _dequantize, _finish_tile, _jit, _wait_for_previous_kernel, gl

_IMPORT_ERROR = HOPPER_IMPORT_ERROR or gluon_int4_mma._IMPORT_ERROR


def available() -> bool:
    return gluon_int4_mma.available() and warpgroup_mma is not None


@functools.cache
def layouts(warps: int, row_tiles: int, block_k: int, rows_x: int) -> dict[str, Any]:
    """The register layouts of a program of `warps` warps (a multiple of 4: whole warpgroups), each decoding
    `row_tiles` tiles of 16 weight rows, `block_k` columns a step, `rows_x` rows of x: W3 as gluon_int4_mma's,
    the accumulator (wgmma, instruction N = rows_x), x's loading layout and its shared-memory layout."""
    base = gluon_int4_mma.layouts(warps, row_tiles, block_k, rows_x)
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, rows_x, 16])
    columns = min(32, block_k // 8)
    x_load = gl.BlockedLayout([1, 8], [32 // columns, columns], [warps, 1], [1, 0])
    x_shared = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return {"W3": base["W3"], "ACC": acc, "XC": x_load, "XS": x_shared, "FIN": base["FIN"]}


@_jit
def _in_wgmma_k_order(t, ROWS: gl.constexpr, BK: gl.constexpr):
    """[ROWS, BK / 8 words, 8] (or [ROWS, BK] in that column order) -> [ROWS, BK] in wgmma's K order. Column
    c = 8 (w + BK / 32 * l) + n (word w of the BK / 32 a thread of lane l % 4 = l holds, nibble n) becomes
    K = 32 w + 16 n2 + 8 n1 + 4 l1 + 2 l0 + n0."""
    bits = gl.reshape(t, [ROWS, 2, 2, BK // 32, 2, 2, 2])  # l1, l0, w, n2, n1, n0
    return gl.reshape(gl.permute(bits, [0, 3, 4, 5, 1, 2, 6]), [ROWS, BK])


@_jit
def _int4_wgmma_kernel(
    x_ptr,
    w_ptr,
    sm_ptr,
    nw_ptr,
    part_ptr,
    squares_ptr,
    arrivals_ptr,
    out_ptr,
    res_ptr,
    b_ptr,
    M,
    N,
    K,
    tiles_per_split,
    eps,
    stride_xm,
    stride_w,
    stride_g,
    stride_om,
    stride_rm,
    GROUP: gl.constexpr,
    NORM: gl.constexpr,
    BIAS: gl.constexpr,
    ACT: gl.constexpr,
    RESIDUAL: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    MP: gl.constexpr,
    W3: gl.constexpr,
    ACC: gl.constexpr,
    XC: gl.constexpr,
    XS: gl.constexpr,
    FIN: gl.constexpr,
    PDL: gl.constexpr,
):
    """Program (n, s, m) as gluon_int4_mma's: weight rows n * BN.. times x rows m * MP.. over K tiles
    s * tiles_per_split.. (of BK columns), the float32 partial product to part[s, x rows, weight rows], the tile's
    last program finishing it into `out`. x (times the norm gain with NORM) is staged in shared memory once per
    program and K step; the next step's weights, scales and x are loaded into registers while this one
    multiplies."""
    LW: gl.constexpr = gl.SliceLayout(2, W3)
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    dt: gl.constexpr = x_ptr.dtype.element_ty
    F16: gl.constexpr = dt == gl.float16
    n_tiles = K // BK
    t_begin = gl.program_id(1) * tiles_per_split
    t_end = gl.minimum(n_tiles, t_begin + tiles_per_split)
    rows = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    words_at = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, LW))
    w_tile = w_ptr + rows[:, None] * stride_w + words_at[None, :]
    g_tile = sm_ptr + rows[:, None] * stride_g + (words_at[None, :] * 8) // GROUP
    xm = gl.program_id(2) * MP + gl.arange(0, MP, layout=gl.SliceLayout(1, XC))
    xc = gl.arange(0, BK, layout=gl.SliceLayout(0, XC))
    x_tile = x_ptr + xm[:, None] * stride_xm + xc[None, :]
    x_mask = (xm < M)[:, None]
    x_shared = gl.allocate_shared_memory(dt, [MP, BK], XS)
    # Weights never depend on earlier kernels: the first tile is fetched before the grid-dependency wait.
    words = gl.load(w_tile + t_begin * (BK // 8))
    pairs = gl.load(g_tile + t_begin * (BK // GROUP))
    _wait_for_previous_kernel(PDL)
    x = gl.load(x_tile + t_begin * BK, mask=x_mask, other=0.0)
    acc = gl.zeros([BN, MP], gl.float32, layout=ACC)
    squares = gl.zeros([MP], gl.float32, layout=gl.SliceLayout(1, XC))
    for t in range(t_begin, t_end):
        cur_words = words
        cur_pairs = pairs
        cur_x = x
        fetch = t + 1 < t_end
        words = gl.load(w_tile + (t + 1) * (BK // 8), mask=fetch)
        pairs = gl.load(g_tile + (t + 1) * (BK // GROUP), mask=fetch)
        x = gl.load(x_tile + (t + 1) * BK, mask=x_mask & fetch, other=0.0)
        if NORM:
            x32 = cur_x.to(gl.float32)
            squares += gl.sum(x32 * x32, axis=1)
            gain = gl.load(nw_ptr + t * BK + xc)
            cur_x = (x32 * gain.to(gl.float32)[None, :]).to(dt)
        gl.thread_barrier()  # the previous step's wgmma has read x_shared in every warp
        x_shared.store(_in_wgmma_k_order(cur_x, MP, BK))
        fence_async_shared()
        gl.thread_barrier()
        w = _in_wgmma_k_order(_dequantize(cur_words, cur_pairs, W3, F16), BN, BK)
        w = gl.convert_layout(w, LA, assert_trivial=True)
        acc = warpgroup_mma(w, x_shared.permute((1, 0)), acc)
    offs_n = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
    offs_m = gl.program_id(2) * MP + gl.arange(0, MP, layout=gl.SliceLayout(0, ACC))
    part = part_ptr + gl.program_id(1) * M * N + offs_m[None, :] * N + offs_n[:, None]
    gl.store(part, acc, mask=(offs_m < M)[None, :])
    if NORM:
        gl.store(squares_ptr + gl.program_id(1) * M + xm, squares, mask=xm < M)
    features = N // 2 if ACT == 1 else N
    feature_tiles = features // BN
    tile = gl.program_id(0) % feature_tiles
    arrivals = arrivals_ptr + gl.program_id(2) * feature_tiles + tile
    expected = gl.num_programs(1) * (2 if ACT == 1 else 1)
    gl.thread_barrier()  # as gluon_int4_mma: every partial store precedes the arrival
    if gl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == expected - 1:
        gl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")
        _finish_tile(part_ptr, squares_ptr, out_ptr, res_ptr, b_ptr, M, N, K, features, gl.num_programs(1), eps,
                     stride_om, stride_rm, tile * BN, gl.program_id(2) * MP, NORM, BIAS, ACT, RESIDUAL, BN, MP,
                     FIN)  # fmt: skip
