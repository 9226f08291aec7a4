"""Gluon product of a few to 64 rows of x times an INT4 matrix on tensor cores (mma.sync m16n8k16, both operands
in registers, no shared memory), for batched decode steps.

Why: at 3-64 rows the one-row GEMVs cost a multiply per weight per row, torch's tinygemm grows with the row
count and cuBLAS on 16-bit copies reads four times the INT4 bytes. Here the weight tile is the MMA's tall
operand ([weight rows, K] x x^T [K, x rows], x rows padded to 16-64), so the row count costs tensor-core time,
which is nearly free at these sizes, and each weight is read and decoded once.

How the layouts line up without a shuffle: the MMA takes each thread's operand values as 8 consecutive K
positions (`k_width` 8), and the kernel is free to choose which column each K position is, as long as weights
and x agree. A thread loads whole 32-bit words (8 columns each) of its weight rows, decodes each word into its
8 register values with a few bit operations (lop3 into 16-bit floats, one fma with the group's scale and
minimum), and reads the same 8 columns of x as one vector. The columns a thread needs are contiguous in
memory because the matrix is kept in `quant.CudaMmaInt4Weight`'s plain column order, with the nibbles inside a
word in the order the decoding emits (`quant.MMA_NIBBLE_OF_COLUMN`). Gluon checks that every layout conversion is a
relabelling (`assert_trivial`).

On Hopper the same kernel has a warpgroup version (`WGMMA`, `KernelPolicy.mma_int4_wgmma`), faster for every
product from 2 rows: mma.sync's operand layout gives each warp its own register copy of the x tile,
so x's loads (and its norm) are repeated in every warp and the instructions grow with the row count (at 32 rows a
seed-407m product issues 0.30-0.80 warp instructions per weight byte, sm_90a, bench/int4_mma_sass.py, against ~0.31
that streaming at the memory's rate allows). The warpgroup version stages x once per program in shared memory,
where wgmma reads it for every warp as its B operand, and keeps the decoded weights in registers as its A operand
(0.19-0.30 at 32 rows). wgmma takes A as pairs of consecutive K positions (a thread holds K = 2t, 2t+1, 2t+8, 2t+9
of each 16), so that version relabels K (`_in_wgmma_k_order`: a word's 8 columns become pairs 0, 8 and 16 apart) and
stores x in shared memory in the same order.

Weights are decoded to 16 bits as (q - 8) * scale + zero in one rounding (scale and zero = minimum + 8 scale
rounded to 16 bits, as torch's tinygemm does: the centred zero is small, so its rounding costs little), the
products are accumulated in float32 over a K split, and the last program to finish a tile of output features
sums its splits and applies 1 / rms, bias, SwiGLU and the residual (`_finish_tile`): each program counts its
arrival on the tile's counter in `CudaMmaInt4Weight.arrivals` and the last one resets it, so a product is one
launch, where a separate epilogue kernel would add a dependent launch to every product of a step. CUDA only
(Gluon has no interpreter); `available()` says whether the installed Triton can build it.
"""

from __future__ import annotations

import functools
from typing import Any

from tinyloop.kernels import triton_matmul
from tinyloop.kernels.gluon_hopper import fence_async_shared, warpgroup_mma

try:  # Gluon is experimental: absent from older Triton, and its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._standard import _import_from_triton
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    # The split-K kernels' epilogue (bias, activation, residual, rounding), compiled as Gluon.
    _epilogue = _import_from_triton(triton_matmul._epilogue)
    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = None
    gl = None
    mma_v2 = None
    _epilogue = None


def available() -> bool:
    return gluon is not None and mma_v2 is not None and hasattr(gl, "DistributedLinearLayout")


def wgmma_available() -> bool:
    """Whether the installed Triton's Gluon can build the warpgroup version."""
    return available() and warpgroup_mma is not None and fence_async_shared is not None


def _jit(fn: Any) -> Any:
    return gluon.jit(fn) if gluon is not None else fn


def _constexpr(value: Any) -> Any:
    return gl.constexpr(value) if gl is not None else value


def _dequant_asm(magic: int, centre: int, op: str) -> str:
    """PTX decoding one word ($4, repeated in $5..$11) with its group's scale and zero, each already in both
    halves of a register ($12 and $20, from `_SPLIT_PAIR` once per group), into 8 16-bit weights ($0..$3):
    (magic | q) - (magic + 8) is q - 8 exactly, then one fma with the scale and the zero."""
    lines = ["{", ".reg .b32 m, c, s2, z2, t;", f"mov.b32 m, {magic:#x};", f"mov.b32 c, {centre:#x};",
             "mov.b32 s2, $12;", "mov.b32 z2, $20;"]  # fmt: skip
    for j in range(4):
        source = "$4"
        if j:
            lines.append(f"shr.u32 t, $4, {4 * j};")
            source = "t"
        lines.append(f"lop3.b32 t, {source}, 0x000F000F, m, 0xEA;")
        lines += [f"sub.rn.{op} t, t, c;", f"fma.rn.{op} ${j}, t, s2, z2;"]
    return "\n".join([*lines, "}"])


_DEQUANT_BF16 = _constexpr(_dequant_asm(0x43004300, 0x43084308, "bf16x2"))  # 128 + q, 136 as bfloat16
_DEQUANT_F16 = _constexpr(_dequant_asm(0x64006400, 0x64086408, "f16x2"))  # 1024 + q, 1032 as float16
_DEQUANT_CONSTRAINTS = _constexpr("=r,=r,=r,=r," + ",".join(["r"] * 24))
# A (scale, zero) pair (scale in the low 16 bits, zero = minimum + 8 scale in the high) -> scale and zero, each in
# both halves of a register.
_SPLIT_PAIR = _constexpr("prmt.b32 $0, $2, $2, 0x1010;\nprmt.b32 $1, $2, $2, 0x3232;")
FINISH_LOADS = _constexpr(4)


def _log2(n: int) -> int:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"expected a power of two, got {n}")
    return n.bit_length() - 1


@functools.cache
def layouts(
    warps: int, row_tiles: int, block_k: int, rows_x: int, wgmma: bool = False, group: int = 64
) -> dict[str, Any]:
    """The layouts of a program with `warps` warps, each multiplying `row_tiles` tiles of 16 weight rows, over
    `block_k` columns per step, with `rows_x` rows of x (16-64); `wgmma`: the warpgroup version (whole
    warpgroups of warps), whose XL is x's loading layout, MMA its accumulator and XS x's shared-memory layout.

    W3: the decoded words [weight rows, block_k / 8 words, 8 columns]; a thread holds block_k / 32 consecutive
    words of two rows (r and r + 8) of each of its row tiles. XL: the x tile [rows_x, block_k] as it is loaded
    (a thread holds 8 * block_k / 32 consecutive columns of rows_x / 8 rows). Both become the MMA's operands
    by reshapes and permutations only (see `_int4_mma_kernel`)."""
    words_per_thread = _log2(block_k // 32)
    word_bases = [[0, 1 << i, 0] for i in range(words_per_thread)]
    row_repeats = [[16 * warps << i, 0, 0] for i in range(_log2(row_tiles))]
    words3 = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], *word_bases, [8, 0, 0], *row_repeats],
        lane_bases=[[0, 1 << words_per_thread, 0], [0, 2 << words_per_thread, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << i, 0, 0] for i in range(_log2(warps))],
        block_bases=[],
        shape=[16 * warps * row_tiles, block_k // 8, 8],
    )
    x_tile = gl.DistributedLinearLayout(
        reg_bases=[
            [0, 1],
            [0, 2],
            [0, 4],
            *([0, 8 << i] for i in range(words_per_thread)),
            *([8 << i, 0] for i in range(_log2(rows_x // 8))),
        ],  # fmt: skip
        lane_bases=[[0, 8 << words_per_thread], [0, 16 << words_per_thread], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0]] * _log2(warps),
        block_bases=[],
        shape=[rows_x, block_k],
    )
    words4 = _by_group(words3, group // 8)
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    finish = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[warps, 1], order=[1, 0])
    if not wgmma:
        return {"W4": words4, "XL": x_tile, "MMA": mma, "FIN": finish, "XS": None, "WGMMA": False}
    columns = min(32, block_k // 8)
    return {
        "W4": words4,
        "XL": gl.BlockedLayout([1, 8], [32 // columns, columns], [warps, 1], [1, 0]),
        "MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, rows_x, 16]),
        "FIN": finish,
        "XS": gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
        "WGMMA": True,
    }


def _by_group(words3: Any, group_words: int) -> Any:
    """The word layout [rows, BK / 8, 8] as [rows, groups, words a group, 8]: the same registers, lanes and warps,
    so that a group's (scale, zero) pair is one value broadcast over its words."""

    def split(basis: list[int]) -> list[int]:
        r, w, c = basis
        return [r, w // group_words, w % group_words, c]

    rows, words, columns = words3.shape
    return gl.DistributedLinearLayout(
        reg_bases=[split(b) for b in words3.reg_bases],
        lane_bases=[split(b) for b in words3.lane_bases],
        warp_bases=[split(b) for b in words3.warp_bases],
        block_bases=[],
        shape=[rows, words // group_words, group_words, columns],
    )


@_jit
def _dequantize(words, pairs, W4: gl.constexpr, F16: gl.constexpr):
    """[BN, groups, words a group] words and their groups' [BN, groups] (scale, zero) pairs -> [BN, BK / 8, 8]
    16-bit weights in the words' column order."""
    scale, zero = gl.inline_asm_elementwise(_SPLIT_PAIR, "=r,=r,r", [pairs], dtype=(gl.int32, gl.int32),
                                            is_pure=True, pack=1)  # fmt: skip
    zeros = gl.full([words.shape[0], words.shape[1], words.shape[2], 8], 0, gl.int32, layout=W4)
    w4 = gl.expand_dims(words, 3) + zeros
    s4 = gl.expand_dims(gl.expand_dims(scale, 2), 3) + zeros
    z4 = gl.expand_dims(gl.expand_dims(zero, 2), 3) + zeros
    if F16:
        w = gl.inline_asm_elementwise(_DEQUANT_F16, _DEQUANT_CONSTRAINTS, [w4, s4, z4], dtype=gl.float16,
                                      is_pure=True, pack=8)  # fmt: skip
    else:
        w = gl.inline_asm_elementwise(_DEQUANT_BF16, _DEQUANT_CONSTRAINTS, [w4, s4, z4], dtype=gl.bfloat16,
                                      is_pure=True, pack=8)  # fmt: skip
    return gl.reshape(w, [words.shape[0], words.shape[1] * words.shape[2], 8])


@_jit
def _in_k_order(t, ROWS: gl.constexpr, BK: gl.constexpr):
    """[ROWS, BK / 8 words, 8] (or [ROWS, BK] in that order) -> [ROWS, BK] in the MMA's K order: word w of a
    thread's 4 lanes x BK / 32 words becomes K block (w % (BK / 32)) * 4 + w // (BK / 32)."""
    return gl.reshape(gl.permute(gl.reshape(t, [ROWS, 4, BK // 32, 8]), [0, 2, 1, 3]), [ROWS, BK])


@_jit
def _in_wgmma_k_order(t, ROWS: gl.constexpr, BK: gl.constexpr):
    """[ROWS, BK / 8 words, 8] (or [ROWS, BK] in that column order) -> [ROWS, BK] in wgmma's K order. Column
    c = 8 (w + BK / 32 * l) + n (word w of the BK / 32 a thread of lane l % 4 = l holds, nibble n) becomes
    K = 32 w + 16 n2 + 8 n1 + 4 l1 + 2 l0 + n0."""
    bits = gl.reshape(t, [ROWS, 2, 2, BK // 32, 2, 2, 2])  # l1, l0, w, n2, n1, n0
    return gl.reshape(gl.permute(bits, [0, 3, 4, 5, 1, 2, 6]), [ROWS, BK])


@_jit
def _wait_for_previous_kernel(PDL: gl.constexpr):
    """Programmatic dependent launch as triton_pdl's: 2 lets the next kernel launch before the wait, 1 after."""
    if PDL == 2:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    if PDL == 1:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@_jit
def _int4_mma_kernel(
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
    W4: gl.constexpr,
    XL: gl.constexpr,
    MMA: gl.constexpr,
    FIN: gl.constexpr,
    XS: gl.constexpr,
    WGMMA: gl.constexpr,
    AHEAD: gl.constexpr,
    PDL: gl.constexpr,
):
    """Program (n, s, m): weight rows n * BN.. times x rows m * MP.. over K tiles s * tiles_per_split.. (of BK
    columns); the float32 partial product goes to part[s, x rows, weight rows], and the tile's last program
    finishes it into `out`. With NORM, x is multiplied by the norm gain here and by 1 / rms when finishing, from
    the sums of squares of x over each split (squares[s, x rows], the same from every tile's programs).
    With ACT 1 (SwiGLU) the weight holds [gate; up] rows and a tile's features need both halves' programs.
    N % BN == 0, (N / 2) % BN == 0 for SwiGLU, and K % BK == 0 (the launcher checks). WGMMA: x (times the norm
    gain with NORM) is staged in shared memory once per K step for wgmma. AHEAD: K tiles loaded ahead of the
    one multiplied (1 or 2: a split is a few tiles, and each further tile in flight hides a DRAM latency)."""
    LW: gl.constexpr = gl.SliceLayout(3, W4)  # [BN, groups, words a group]
    LP: gl.constexpr = gl.SliceLayout(2, LW)  # [BN, groups]
    GW: gl.constexpr = GROUP // 8
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2 if WGMMA else 8)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    dt: gl.constexpr = x_ptr.dtype.element_ty
    F16: gl.constexpr = dt == gl.float16
    n_tiles = K // BK
    t_begin = gl.program_id(1) * tiles_per_split
    t_end = gl.minimum(n_tiles, t_begin + tiles_per_split)
    rows = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))
    groups_at = gl.arange(0, BK // GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    words_at = gl.arange(0, GW, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    w_tile = w_ptr + rows[:, None, None] * stride_w + groups_at[None, :, None] * GW + words_at[None, None, :]
    pair_rows = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LP))
    g_tile = sm_ptr + pair_rows[:, None] * stride_g + gl.arange(0, BK // GROUP, layout=gl.SliceLayout(0, LP))[None, :]
    xm = gl.program_id(2) * MP + gl.arange(0, MP, layout=gl.SliceLayout(1, XL))
    xc = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    x_tile = x_ptr + xm[:, None] * stride_xm + xc[None, :]
    x_mask = (xm < M)[:, None]
    if WGMMA:
        x_shared = gl.allocate_shared_memory(dt, [MP, BK], XS)
    # Weights never depend on earlier kernels: the first tiles are fetched before the grid-dependency wait.
    words = gl.load(w_tile + t_begin * (BK // 8))
    pairs = gl.load(g_tile + t_begin * (BK // GROUP))
    words_later = words
    pairs_later = pairs
    later = t_begin + 1 < t_end
    if AHEAD == 2:
        words_later = gl.load(w_tile + (t_begin + 1) * (BK // 8), mask=later)
        pairs_later = gl.load(g_tile + (t_begin + 1) * (BK // GROUP), mask=later)
    _wait_for_previous_kernel(PDL)
    x = gl.load(x_tile + t_begin * BK, mask=x_mask, other=0.0)
    x_later = x
    if AHEAD == 2:
        x_later = gl.load(x_tile + (t_begin + 1) * BK, mask=x_mask & later, other=0.0)
    acc = gl.zeros([BN, MP], gl.float32, layout=MMA)
    squares = gl.zeros([MP], gl.float32, layout=gl.SliceLayout(1, XL))
    for t in range(t_begin, t_end):
        cur_words = words
        cur_pairs = pairs
        cur_x = x
        fetch = t + AHEAD < t_end
        fetched_words = gl.load(w_tile + (t + AHEAD) * (BK // 8), mask=fetch)
        fetched_pairs = gl.load(g_tile + (t + AHEAD) * (BK // GROUP), mask=fetch)
        fetched_x = gl.load(x_tile + (t + AHEAD) * BK, mask=x_mask & fetch, other=0.0)
        if AHEAD == 2:
            words, pairs, x = words_later, pairs_later, x_later
            words_later, pairs_later, x_later = fetched_words, fetched_pairs, fetched_x
        else:
            words, pairs, x = fetched_words, fetched_pairs, fetched_x
        if NORM:
            x32 = cur_x.to(gl.float32)
            squares += gl.sum(x32 * x32, axis=1)
            gain = gl.load(nw_ptr + t * BK + xc)
            cur_x = (cur_x.to(gl.float32) * gain.to(gl.float32)[None, :]).to(dt)
        if WGMMA:
            gl.thread_barrier()  # the previous step's wgmma has read x_shared in every warp
            x_shared.store(_in_wgmma_k_order(cur_x, MP, BK))
            fence_async_shared()
            gl.thread_barrier()
            w = _in_wgmma_k_order(_dequantize(cur_words, cur_pairs, W4, F16), BN, BK)
            acc = warpgroup_mma(gl.convert_layout(w, LA, assert_trivial=True), x_shared.permute((1, 0)), acc)
        else:
            xt = gl.convert_layout(gl.permute(_in_k_order(cur_x, MP, BK), [1, 0]), LB, assert_trivial=True)
            w = _in_k_order(_dequantize(cur_words, cur_pairs, W4, F16), BN, BK)
            w = gl.convert_layout(w, LA, assert_trivial=True)
            acc = mma_v2(w, xt, acc)
    offs_n = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    offs_m = gl.program_id(2) * MP + gl.arange(0, MP, layout=gl.SliceLayout(0, MMA))
    part = part_ptr + gl.program_id(1) * M * N + offs_m[None, :] * N + offs_n[:, None]
    gl.store(part, acc, mask=(offs_m < M)[None, :])
    if NORM:
        gl.store(squares_ptr + gl.program_id(1) * M + xm, squares, mask=xm < M)
    features = N // 2 if ACT == 1 else N
    feature_tiles = features // BN
    tile = gl.program_id(0) % feature_tiles
    arrivals = arrivals_ptr + gl.program_id(2) * feature_tiles + tile
    expected = gl.num_programs(1) * (2 if ACT == 1 else 1)
    # Every thread's partial stores precede the arrival (the barrier), which releases them at GPU scope; the
    # last arrival acquires the others' (CUTLASS's split-K semaphore does the same).
    gl.thread_barrier()
    if gl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == expected - 1:
        gl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")
        _finish_tile(part_ptr, squares_ptr, out_ptr, res_ptr, b_ptr, M, N, K, features, gl.num_programs(1), eps,
                     stride_om, stride_rm, tile * BN, gl.program_id(2) * MP, NORM, BIAS, ACT, RESIDUAL, BN, MP,
                     FIN)  # fmt: skip


@_jit
def _finish_tile(part_ptr, squares_ptr, out_ptr, res_ptr, b_ptr, M, N, K, features, splits, eps, stride_om,
                 stride_rm, feature0, m0, NORM: gl.constexpr, BIAS: gl.constexpr, ACT: gl.constexpr,
                 RESIDUAL: gl.constexpr, BN: gl.constexpr, MP: gl.constexpr, FIN: gl.constexpr):  # fmt: skip
    """out[m0.., feature0..] = the splits' partial products summed in split order, times 1 / rms(x) with NORM,
    then `triton_matmul._epilogue` (bias, activation, residual). Partials are read past L1 (.cg): other SMs
    wrote them."""
    offs_m = m0 + gl.arange(0, MP, layout=gl.SliceLayout(1, FIN))
    offs_f = feature0 + gl.arange(0, BN, layout=gl.SliceLayout(0, FIN))
    m_mask = offs_m < M
    mask = m_mask[:, None] & (offs_f < features)[None, :]
    acc = gl.zeros([MP, BN], gl.float32, layout=FIN)
    acc_up = gl.zeros([MP, BN], gl.float32, layout=FIN)
    squares = gl.zeros([MP], gl.float32, layout=gl.SliceLayout(1, FIN))
    at = part_ptr + offs_m[:, None] * N + offs_f[None, :]
    # Splits are read FINISH_LOADS at a time (unrolled, independent loads): one L2 round trip per split made
    # the finish a chain of `splits` round trips.
    for s0 in range(0, splits, FINISH_LOADS):
        for j in gl.static_range(FINISH_LOADS):
            s = s0 + j
            live = s < splits
            acc += gl.load(at + s * M * N, mask=mask & live, other=0.0, cache_modifier=".cg")
            if ACT == 1:
                acc_up += gl.load(at + s * M * N + features, mask=mask & live, other=0.0, cache_modifier=".cg")
            if NORM:
                squares += gl.load(squares_ptr + s * M + offs_m, mask=m_mask & live, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
    if NORM:
        rstd = 1.0 / gl.sqrt(squares / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    _epilogue(acc, acc_up, offs_m, m_mask, offs_f, offs_f < features, out_ptr, stride_om, res_ptr, stride_rm, b_ptr,
              BIAS, ACT, RESIDUAL)  # fmt: skip
