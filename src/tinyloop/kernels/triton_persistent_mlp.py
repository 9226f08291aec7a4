"""The MLP sublayer of one decode step (1-4 rows) as work items of one persistent Triton kernel
(docs/DECODE_DATAFLOW.md, step 1): RMSNorm + gate / up + SwiGLU, then the down projection (+ residual).

Items, in topological order, taken from a ticket counter by whichever program is free (or, with STATIC,
round-robin by program):
- gate / up item t: rows t * GU_N.. of gate and of up over all of x (the norm's mean square computed on the
  way), SwiGLU into h[:, those features]; then one arrival on its K slice's ready counter.
- down item (s, n): output rows n * DN_N.. times h's K slice s (SLICE features). Its weights are loaded
  before it waits for the slice's gate / up items; its float32 partial sum goes into acc by atomics, and the
  last of the n_slices items of an output tile takes the sum (zeroing acc), adds the residual and rounds.
An item only waits on items with smaller tickets, which running programs hold, so nothing deadlocks; and run
one program at a time (Triton's interpreter; one program in all with STATIC) no item ever waits, so the CPU
tests run this same code.
Every launch leaves its counters and acc zero for the next one (the last program out resets the ticket).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyloop.kernels.triton_matmul import _blocked_f, _epilogue, _load_blocked_tile
from tinyloop.kernels.triton_pdl import _wait_for_previous_kernel

# sync (int32): [TICKET, EXITS, ready per K slice (n_slices), arrivals per output tile (n_out)]
TICKET, EXITS, READY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _x_words(x_ptr, stride_xm, offs_m, x_mask, zero_rows, blk, offs_i, j: tl.constexpr, WORDS: tl.constexpr,
             BLOCK: tl.constexpr, FRESH: tl.constexpr):  # fmt: skip
    """x's columns under nibble j of the weight words [rows, blocks, words], in the tile's shape and layout;
    FRESH: written by other programs of this launch, so read from L2 (.cg), not a stale L1 line."""
    cols = zero_rows + (blk * BLOCK + WORDS * j)[None, :, None] + offs_i[None, None, :]
    ptrs = x_ptr + offs_m[:, None, None, None] * stride_xm + cols[None]
    if FRESH:
        xj = tl.load(ptrs, mask=x_mask, other=0.0, cache_modifier=".cg")
    else:
        xj = tl.load(ptrs, mask=x_mask, other=0.0)
    return xj.to(tl.float32), cols


@triton.jit
def _gate_up_item(t, x_ptr, stride_xm, nw_ptr, eps, w_ptr, s_ptr, m_ptr, h_ptr, stride_hm, sync_ptr, M, F, D,
                  GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, GU_N: tl.constexpr,
                  GU_B: tl.constexpr, SLICE: tl.constexpr):  # fmt: skip
    """h[:, t * GU_N..] = SwiGLU(rmsnorm(x) @ [gate; up].T) for those features, rounded as the fused GEMV
    rounds (kernels/triton_matmul.py `_gemv_blocked_int4_kernel` with NORM and ACT = 1)."""
    WORDS: tl.constexpr = BLOCK // 8
    rows = t * GU_N + tl.arange(0, GU_N)
    row_mask = rows < F
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    offs_i = tl.arange(0, WORDS)
    n_blocks = D // BLOCK
    stride_w, stride_g = D // 8, D // GROUP
    blk = tl.arange(0, GU_B)
    words, s, mn = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, blk, n_blocks, stride_w, stride_g, GROUP,
                                      BLOCK)  # fmt: skip
    words_up, s_up, mn_up = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows + F, row_mask, blk, n_blocks, stride_w,
                                               stride_g, GROUP, BLOCK)  # fmt: skip
    acc = tl.zeros((ROWS, GU_N, GU_B), tl.float32)
    acc_up = tl.zeros((ROWS, GU_N, GU_B), tl.float32)
    sumsq = tl.zeros((ROWS, GU_N, GU_B, WORDS), tl.float32)
    zero_rows = (rows * 0)[:, None, None]
    for kb in range(0, n_blocks, GU_B):
        blk = kb + tl.arange(0, GU_B)
        x_mask = m_mask[:, None, None, None] & (row_mask[:, None, None] & (blk < n_blocks)[None, :, None])[None]
        cur, cur_s, cur_mn, cur_up, cur_s_up, cur_mn_up = words, s, mn, words_up, s_up, mn_up
        words, s, mn = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, blk + GU_B, n_blocks, stride_w,
                                          stride_g, GROUP, BLOCK)  # fmt: skip
        words_up, s_up, mn_up = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows + F, row_mask, blk + GU_B, n_blocks,
                                                   stride_w, stride_g, GROUP, BLOCK)  # fmt: skip
        part = tl.zeros((ROWS, GU_N, GU_B, WORDS), tl.float32)
        part_up = tl.zeros((ROWS, GU_N, GU_B, WORDS), tl.float32)
        xsum = tl.zeros((ROWS, GU_N, GU_B, WORDS), tl.float32)
        for j in tl.static_range(8):
            xj, cols = _x_words(x_ptr, stride_xm, offs_m, x_mask, zero_rows, blk, offs_i, j, WORDS, BLOCK, False)
            sumsq += xj * xj
            g = tl.load(nw_ptr + cols, mask=(blk < n_blocks)[None, :, None], other=0.0)
            xj = xj * g.to(tl.float32)[None]
            xsum += xj
            part += _blocked_f(cur, j)[None] * xj
            part_up += _blocked_f(cur_up, j)[None] * xj
        xs = tl.sum(xsum, axis=3)
        acc += cur_s[None] * (16.0 * (tl.sum(part, axis=3) - xs)) + cur_mn[None] * xs
        acc_up += cur_s_up[None] * (16.0 * (tl.sum(part_up, axis=3) - xs)) + cur_mn_up[None] * xs
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(sumsq, axis=3), axis=2) / D + eps)
    _epilogue(tl.sum(acc, axis=2) * rstd, tl.sum(acc_up, axis=2) * rstd, offs_m, m_mask, rows, row_mask, h_ptr,
              stride_hm, h_ptr, stride_hm, h_ptr, False, 1, False)  # fmt: skip
    tl.debug_barrier()  # every thread's h written before the slice's counter says so
    tl.atomic_add(sync_ptr + READY + (t * GU_N) // SLICE, 1, sem="release")


@triton.jit
def _down_item(sl, n, h_ptr, stride_hm, w_ptr, s_ptr, m_ptr, acc_ptr, out_ptr, stride_om, res_ptr, stride_rm, sync_ptr,
               M, F, D, n_slices, GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, GU_N: tl.constexpr,
               SLICE: tl.constexpr, DN_N: tl.constexpr, RESIDUAL: tl.constexpr):  # fmt: skip
    """Output rows n * DN_N.. of h @ down.T over K slice `sl`, added into acc; the tile's last slice finishes
    it: acc (read from L2 and zeroed), rounded, plus the residual, rounded again (as `_epilogue` with RESIDUAL)."""
    WORDS: tl.constexpr = BLOCK // 8
    BLOCKS: tl.constexpr = SLICE // BLOCK
    rows = n * DN_N + tl.arange(0, DN_N)
    row_mask = rows < D
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    offs_i = tl.arange(0, WORDS)
    n_blocks = F // BLOCK
    blk = sl * BLOCKS + tl.arange(0, BLOCKS)
    # The weights first: they stream while this item waits for its slice of h.
    words, s, mn = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, blk, n_blocks, F // 8, F // GROUP, GROUP,
                                      BLOCK)  # fmt: skip
    n_producers = SLICE // GU_N
    while tl.atomic_add(sync_ptr + READY + sl, 0, sem="acquire") < n_producers:
        pass
    zero_rows = (rows * 0)[:, None, None]
    x_mask = m_mask[:, None, None, None] & (row_mask[:, None, None] & (blk < n_blocks)[None, :, None])[None]
    part = tl.zeros((ROWS, DN_N, BLOCKS, WORDS), tl.float32)
    xsum = tl.zeros((ROWS, DN_N, BLOCKS, WORDS), tl.float32)
    for j in tl.static_range(8):
        xj, cols = _x_words(h_ptr, stride_hm, offs_m, x_mask, zero_rows, blk, offs_i, j, WORDS, BLOCK, True)
        xsum += xj
        part += _blocked_f(words, j)[None] * xj
    xs = tl.sum(xsum, axis=3)
    partial = tl.sum(s[None] * (16.0 * (tl.sum(part, axis=3) - xs)) + mn[None] * xs, axis=2)
    mask = m_mask[:, None] & row_mask[None, :]
    acc = acc_ptr + offs_m[:, None] * D + rows[None, :]
    tl.atomic_add(acc, partial, mask=mask, sem="relaxed")
    tl.debug_barrier()  # every thread's partial added before the tile's count says so
    count = sync_ptr + READY + n_slices + n
    if tl.atomic_add(count, 1, sem="acq_rel") == n_slices - 1:
        total = tl.load(acc, mask=mask, other=0.0, cache_modifier=".cg")  # the atomics' sums, in L2
        tl.store(acc, tl.zeros((ROWS, DN_N), tl.float32), mask=mask)
        tl.atomic_xchg(count, 0)
        _epilogue(total, total, offs_m, m_mask, rows, row_mask, out_ptr, stride_om, res_ptr, stride_rm, out_ptr,
                  False, 0, RESIDUAL)  # fmt: skip


@triton.jit
def _persistent_mlp_kernel(
    x_ptr,
    nw_ptr,
    gu_ptr,
    gu_s_ptr,
    gu_m_ptr,
    dn_ptr,
    dn_s_ptr,
    dn_m_ptr,
    h_ptr,
    acc_ptr,
    out_ptr,
    res_ptr,
    sync_ptr,
    M,
    F,
    D,
    eps,
    stride_xm,
    stride_hm,
    stride_om,
    stride_rm,
    n_programs,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    GU_N: tl.constexpr,
    GU_B: tl.constexpr,
    SLICE: tl.constexpr,
    DN_N: tl.constexpr,
    TICKETS: tl.constexpr,
    STATIC: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = down(SwiGLU(rmsnorm(x) @ gate_up.T)) (+ residual) for x [M, D], gate_up [2F, D] and down [D, F] in
    the blocked INT4 layout; h [M, F] (x's dtype), acc [M, D] float32 (zero) and sync (zero) are scratch.
    `out` may be the residual itself: its tiles are written after every item has read x.
    TICKETS: consecutive items per ticket (one atomic per TICKETS items). STATIC: no ticket counter, program p
    takes items p, p + n_programs, ... (TICKETS at a time), which needs every program resident at once: a
    program waits on items of programs that may not have started (one program in the interpreter)."""
    n_gate_up = tl.cdiv(F, GU_N)
    n_slices = F // SLICE
    n_out = tl.cdiv(D, DN_N)
    n_items = n_gate_up + n_slices * n_out
    _wait_for_previous_kernel(PDL)
    if STATIC:
        item = tl.program_id(0) * TICKETS
    else:
        item = tl.atomic_add(sync_ptr + TICKET, TICKETS, sem="relaxed")
    while item < n_items:
        # A program runs its items in ascending order, so the smallest unfinished item is always running
        # and everything it waits on is done: no deadlock while every program is resident.
        for k in tl.static_range(TICKETS):
            if item + k < n_items:
                if item + k < n_gate_up:
                    _gate_up_item(item + k, x_ptr, stride_xm, nw_ptr, eps, gu_ptr, gu_s_ptr, gu_m_ptr, h_ptr,
                                  stride_hm, sync_ptr, M, F, D, GROUP, BLOCK, ROWS, GU_N, GU_B, SLICE)  # fmt: skip
                else:
                    d = item + k - n_gate_up  # slice-major: the earliest slices' items come first
                    _down_item(d // n_out, d % n_out, h_ptr, stride_hm, dn_ptr, dn_s_ptr, dn_m_ptr, acc_ptr,
                               out_ptr, stride_om, res_ptr, stride_rm, sync_ptr, M, F, D, n_slices, GROUP, BLOCK,
                               ROWS, GU_N, SLICE, DN_N, RESIDUAL)  # fmt: skip
        if STATIC:
            item += n_programs * TICKETS
        else:
            item = tl.atomic_add(sync_ptr + TICKET, TICKETS, sem="relaxed")
    # The last program out finds every item done and resets the counters for the next launch (or replay).
    if tl.atomic_add(sync_ptr + EXITS, 1, sem="acq_rel") == n_programs - 1:
        for i in range(0, n_slices):
            tl.atomic_xchg(sync_ptr + READY + i, 0, sem="relaxed")
        tl.atomic_xchg(sync_ptr + TICKET, 0, sem="relaxed")
        tl.atomic_xchg(sync_ptr + EXITS, 0, sem="release")
