"""One-token attention and the output projection in one launch (docs/DECODE_DATAFLOW.md, step 2): the decode
chain loses a phase boundary per layer application.

Program (h, t, b): query head h of row b attends over its whole cache (RoPE, and where it is the first program
of its kv head, the cache write, as `_rope_attention_kernel` does) and multiplies the head's output by its slice
of the INT4 output projection (columns h * HEAD_DIM.., output rows t * BLOCK_N..). Every program of an output tile
repeats its head's attention instead of waiting for another program's, so no program ever waits and the launch
needs no residency; the keys it reads again come from L2. The heads' float32 partial products meet in scratch; the
head that arrives last at an output tile sums them in head order (the same bits whatever the arrival order),
rounds, adds the residual and rounds again (the rounding points of the two launches it replaces), and zeroes the
tile's arrival count for the next launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyloop.kernels.triton_attention import _attend_state
from tinyloop.kernels.triton_matmul import _blocked_f, _epilogue, _load_blocked_tile


@triton.jit
def _attention_out_kernel(
    qkv_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, s_ptr, m_ptr, heads_ptr, part_ptr,
    count_ptr, out_ptr, res_ptr, scale, D, stride_qkv, stride_cb, stride_ch, stride_cs, stride_w, stride_g,
    stride_om, stride_rm, N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_S: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    HEADS_P2: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    t = tl.program_id(1)
    b = tl.program_id(2)
    n_tiles = tl.num_programs(1)
    pos = tl.load(pos_ptr + b)
    WORDS: tl.constexpr = BLOCK // 8
    HEAD_BLOCKS: tl.constexpr = HEAD_DIM // BLOCK
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < D
    # The weights never depend on earlier kernels: loaded before the attention's wait on the previous kernel.
    blk = h * HEAD_BLOCKS + tl.arange(0, HEAD_BLOCKS)
    words, s, mn = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, blk, N_HEADS * HEAD_BLOCKS, stride_w,
                                      stride_g, GROUP, BLOCK)  # fmt: skip
    writes_cache = (t == 0) & (h % (N_HEADS // N_KV) == 0)
    m_i, l_i, acc = _attend_state(qkv_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, scale, stride_qkv, stride_cb,
                                  stride_ch, stride_cs, b, h, pos, 0, pos, True, writes_cache, N_HEADS, N_KV,
                                  HEAD_DIM, INTERLEAVED, BLOCK_S, True, PDL)  # fmt: skip
    # The head's output, rounded as the attention kernel stores it, goes through this program's own scratch row to
    # come back in the weight tile's layout (word i of a block holds columns WORDS * j + i, nibble j).
    offs_d = tl.arange(0, HEAD_DIM)
    mine = heads_ptr + ((b * N_HEADS + h) * n_tiles + t) * HEAD_DIM
    tl.store(mine + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty).to(tl.float32))
    tl.debug_barrier()
    offs_i = tl.arange(0, WORDS)
    zero_rows = (rows * 0)[:, None, None]
    part = tl.zeros((BLOCK_N, HEAD_BLOCKS, WORDS), tl.float32)
    for j in tl.static_range(8):
        cols = zero_rows + (tl.arange(0, HEAD_BLOCKS) * BLOCK + WORDS * j)[None, :, None] + offs_i[None, None, :]
        part += _blocked_f(words, j) * tl.load(mine + cols)
    # per block: sum_k o_k q_k = 16 (sum_k o_k (1 + q_k / 16) - sum_k o_k), then scale and minimum
    o_sum = tl.sum(tl.load(mine + tl.arange(0, HEAD_BLOCKS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]), axis=1)
    y = tl.sum(s * (16.0 * (tl.sum(part, axis=2) - o_sum[None, :])) + mn * o_sum[None, :], axis=1)  # [BLOCK_N]
    offs_n = tl.arange(0, BLOCK_N)
    first = (b * n_tiles + t) * N_HEADS
    tl.store(part_ptr + (first + h) * BLOCK_N + offs_n, y)
    tl.debug_barrier()  # every thread's partial written before the count says so
    count = count_ptr + b * n_tiles + t
    arrived = tl.atomic_add(count, 1, sem="acq_rel")
    if arrived == N_HEADS - 1:
        offs_h = tl.arange(0, HEADS_P2)
        parts = tl.load(part_ptr + (first + offs_h)[:, None] * BLOCK_N + offs_n[None, :],
                        mask=(offs_h < N_HEADS)[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        total = tl.sum(parts, axis=0)[None, :]
        one = tl.arange(0, 1)
        _epilogue(total, total, one, one < 1, rows, row_mask, out_ptr + b * stride_om, stride_om,
                  res_ptr + b * stride_rm, stride_rm, w_ptr, False, 0, RESIDUAL)  # fmt: skip
        tl.atomic_xchg(count, 0)
