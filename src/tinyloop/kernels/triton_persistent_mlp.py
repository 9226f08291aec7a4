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

# sync (int32): [TICKET, EXITS, ready per K slice (n_slices), arrivals per output tile (n_out), prologue flag]
TICKET, EXITS, READY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _nibble_f(words, j: tl.constexpr, nibble_mask, MASK_ARG: tl.constexpr):
    """`_blocked_f` (nibble j as the float32 1 + q / 16); MASK_ARG: the mask 0x00780000 comes as a run-time
    value, so ptxas fuses mask and exponent into one LOP3 (a literal mask takes two)."""
    if MASK_ARG:
        if j < 5:
            shifted = words << (19 - 4 * j)
        else:
            shifted = words >> (4 * j - 19)
        return ((shifted & nibble_mask) | 0x3F800000).to(tl.float32, bitcast=True)
    else:
        return _blocked_f(words, j)


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
def _x_prologue(x_ptr, stride_xm, nw_ptr, eps, xn_ptr, sync_ptr, flag, M, D, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                XB: tl.constexpr):  # fmt: skip
    """The prologue item: x * g in float32 [M, D] and 1 / rms(x) [M] into xn, for every gate / up item to read
    instead of converting, scaling and squaring x itself; then the flag."""
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    offs_c = tl.arange(0, BLOCK)
    n_blocks = D // BLOCK
    sumsq = tl.zeros((ROWS, XB, BLOCK), tl.float32)
    for kb in range(0, n_blocks, XB):
        blk = kb + tl.arange(0, XB)
        cols = (blk * BLOCK)[:, None] + offs_c[None, :]
        mask = m_mask[:, None, None] & (blk < n_blocks)[None, :, None]
        x = tl.load(x_ptr + offs_m[:, None, None] * stride_xm + cols[None], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(nw_ptr + cols, mask=(blk < n_blocks)[:, None], other=0.0).to(tl.float32)
        sumsq += x * x
        xg = x * g[None]
        tl.store(xn_ptr + offs_m[:, None, None] * D + cols[None], xg, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(sumsq, axis=2), axis=1) / D + eps)
    tl.store(xn_ptr + M * D + offs_m, rstd, mask=m_mask)
    tl.debug_barrier()  # every thread's stores issued before the flag says so
    tl.atomic_add(sync_ptr + flag, 1, sem="release")


@triton.jit
def _gate_up_item(t, x_ptr, stride_xm, nw_ptr, eps, w_ptr, s_ptr, m_ptr, stride_w, stride_g, h_ptr, stride_hm,
                  sync_ptr, M, F, D, xn_ptr, flag, nibble_mask, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                  ROWS: tl.constexpr, GU_N: tl.constexpr, GU_B: tl.constexpr, SLICE: tl.constexpr,
                  XPRO: tl.constexpr, MASK_ARG: tl.constexpr, H32: tl.constexpr):  # fmt: skip
    """h[:, t * GU_N..] = SwiGLU(rmsnorm(x) @ [gate; up].T) for those features, rounded as the fused GEMV
    rounds (kernels/triton_matmul.py `_gemv_blocked_int4_kernel` with NORM and ACT = 1). XPRO: x * g and
    1 / rms(x) come from the prologue item (xn), waited for after the first weight loads.
    H32: h is float32 (the same rounded values), which the down items load in their weights' register layout."""
    WORDS: tl.constexpr = BLOCK // 8
    rows = t * GU_N + tl.arange(0, GU_N)
    row_mask = rows < F
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    offs_i = tl.arange(0, WORDS)
    n_blocks = D // BLOCK
    blk = tl.arange(0, GU_B)
    words, s, mn = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, blk, n_blocks, stride_w, stride_g, GROUP,
                                      BLOCK)  # fmt: skip
    words_up, s_up, mn_up = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows + F, row_mask, blk, n_blocks, stride_w,
                                               stride_g, GROUP, BLOCK)  # fmt: skip
    if XPRO:
        while tl.atomic_add(sync_ptr + flag, 0, sem="acquire") < 1:
            pass
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
        if XPRO:
            for j in tl.static_range(8):
                cols = zero_rows + (blk * BLOCK + WORDS * j)[None, :, None] + offs_i[None, None, :]
                xj = tl.load(xn_ptr + offs_m[:, None, None, None] * D + cols[None], mask=x_mask, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
                xsum += xj
                part += _nibble_f(cur, j, nibble_mask, MASK_ARG)[None] * xj
                part_up += _nibble_f(cur_up, j, nibble_mask, MASK_ARG)[None] * xj
        else:
            for j in tl.static_range(8):
                xj, cols = _x_words(x_ptr, stride_xm, offs_m, x_mask, zero_rows, blk, offs_i, j, WORDS, BLOCK, False)
                sumsq += xj * xj
                g = tl.load(nw_ptr + cols, mask=(blk < n_blocks)[None, :, None], other=0.0)
                xj = xj * g.to(tl.float32)[None]
                xsum += xj
                part += _nibble_f(cur, j, nibble_mask, MASK_ARG)[None] * xj
                part_up += _nibble_f(cur_up, j, nibble_mask, MASK_ARG)[None] * xj
        xs = tl.sum(xsum, axis=3)
        acc += cur_s[None] * (16.0 * (tl.sum(part, axis=3) - xs)) + cur_mn[None] * xs
        acc_up += cur_s_up[None] * (16.0 * (tl.sum(part_up, axis=3) - xs)) + cur_mn_up[None] * xs
    if XPRO:
        rstd = tl.load(xn_ptr + M * D + offs_m[:, None] + (rows * 0)[None, :],
                       mask=m_mask[:, None], other=1.0, cache_modifier=".cg")  # fmt: skip
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(sumsq, axis=3), axis=2) / D + eps)
    if H32:  # SwiGLU rounded as `_epilogue` rounds it (to x's dtype), kept in float32
        dt = x_ptr.dtype.element_ty
        y = (tl.sum(acc, axis=2) * rstd).to(dt).to(tl.float32)
        up = (tl.sum(acc_up, axis=2) * rstd).to(dt).to(tl.float32)
        y = ((y * tl.sigmoid(y)).to(dt).to(tl.float32) * up).to(dt).to(tl.float32)
        tl.store(h_ptr + offs_m[:, None] * stride_hm + rows[None, :], y, mask=m_mask[:, None] & row_mask[None, :])
    else:
        _epilogue(tl.sum(acc, axis=2) * rstd, tl.sum(acc_up, axis=2) * rstd, offs_m, m_mask, rows, row_mask, h_ptr,
                  stride_hm, h_ptr, stride_hm, h_ptr, False, 1, False)  # fmt: skip
    tl.debug_barrier()  # every thread's h written before the slice's counter says so
    tl.atomic_add(sync_ptr + READY + (t * GU_N) // SLICE, 1, sem="release")


@triton.jit
def _down_item(sl, n, h_ptr, stride_hm, w_ptr, s_ptr, m_ptr, stride_w, stride_g, acc_ptr, out_ptr, stride_om,
               res_ptr, stride_rm, sync_ptr, M, F, D, n_slices, nibble_mask, GROUP: tl.constexpr, BLOCK: tl.constexpr,
               ROWS: tl.constexpr, GU_N: tl.constexpr, SLICE: tl.constexpr, DN_N: tl.constexpr,
               RESIDUAL: tl.constexpr, MASK_ARG: tl.constexpr):  # fmt: skip
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
    words, s, mn = _load_blocked_tile(w_ptr, s_ptr, m_ptr, rows, row_mask, blk, n_blocks, stride_w, stride_g, GROUP,
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
        part += _nibble_f(words, j, nibble_mask, MASK_ARG)[None] * xj
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
def _l2_prefetch(ptrs, nbytes, on):
    """Hopper's bulk prefetch of `nbytes` bytes at each of `ptrs` into L2 where `on` (no registers, no wait)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [ptrs, nbytes, on.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _l2_prefetch_line(ptrs, on):
    """The 128-byte line at each of `ptrs` into L2 where `on` (a per-thread prefetch; the bulk one is uniform, so
    distinct addresses would be issued one lane at a time)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, on.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_item(it, gu_ptr, gu_s_ptr, gu_m_ptr, dn_ptr, stride_gu_w, stride_gu_g, stride_dn_w, F, D, n_gate_up,
                   n_items, n_out, GU_N: tl.constexpr, SLICE: tl.constexpr, DN_N: tl.constexpr,
                   THREADS: tl.constexpr):  # fmt: skip
    """Item `it`'s weights into L2: a gate / up item's six contiguous ranges (gate and up words, scales,
    minimums) by bulk prefetches of lanes 0-5 (the launcher checks that they are 16-byte aligned and sized), a
    down item's slice of each of its rows by line prefetches, one line per lane (rows beyond the lanes are left
    to the item's own loads, as are its scales and minimums)."""
    lane = tl.arange(0, THREADS)
    if it >= 0:
        if it < n_gate_up:
            row0 = it * GU_N
            rows = tl.minimum(GU_N, F - row0)
            up = lane % 2  # lanes 0-5: gate words, up words, gate scales, up scales, gate minimums, up minimums
            words = gu_ptr + (row0 + up * F).to(tl.int64) * stride_gu_w
            _l2_prefetch(words, rows * stride_gu_w * 4, lane < 2)
            groups = (row0 + up * F).to(tl.int64) * stride_gu_g
            _l2_prefetch(gu_s_ptr + groups, rows * stride_gu_g * 2, (lane >= 2) & (lane < 4))
            _l2_prefetch(gu_m_ptr + groups, rows * stride_gu_g * 2, (lane >= 4) & (lane < 6))
        elif it < n_items:
            d = it - n_gate_up
            sl, n = d // n_out, d % n_out
            lines: tl.constexpr = (SLICE // 2 + 127) // 128  # 128-byte lines per row of the slice
            row = n * DN_N + lane // lines
            ptrs = dn_ptr + row.to(tl.int64) * stride_dn_w + sl * (SLICE // 8) + (lane % lines) * 32
            _l2_prefetch_line(ptrs, (lane < DN_N * lines) & (row < D))


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
    xn_ptr,
    M,
    F,
    D,
    eps,
    stride_xm,
    stride_hm,
    stride_om,
    stride_rm,
    stride_gu_w,
    stride_gu_g,
    stride_dn_w,
    stride_dn_g,
    n_programs,
    nibble_mask,
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
    XPRO: tl.constexpr,
    MASK_ARG: tl.constexpr,
    H32: tl.constexpr,
    PREFETCH: tl.constexpr,
    THREADS: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = down(SwiGLU(rmsnorm(x) @ gate_up.T)) (+ residual) for x [M, D], gate_up [2F, D] and down [D, F] in
    the blocked INT4 layout (int32 words and groups per row: stride_gu_* = D / 8, D / GROUP and stride_dn_* = F / 8,
    F / GROUP, arguments so that Triton sees their alignment and loads 16 bytes at a time); h [M, F] (x's dtype),
    acc [M, D] float32 (zero) and sync (zero) are scratch.
    `out` may be the residual itself: its tiles are written after every item has read x.
    TICKETS: consecutive items per ticket (one atomic per TICKETS items). STATIC: no ticket counter, program p
    takes items p, p + n_programs, ... (TICKETS at a time), which needs every program resident at once: a
    program waits on items of programs that may not have started (one program in the interpreter).
    XPRO: a prologue item (ticket 0) writes x * g and 1 / rms(x) to xn (float32 [M * (D + 1)]) for the gate / up
    items. MASK_ARG: the nibble mask is `nibble_mask` (0x00780000), a run-time
    value (one LOP3 per nibble). H32: h is float32. PREFETCH (Hopper; THREADS = 32 * warps): program p asks L2
    for item p's weights before the PDL wait (with STATIC its own first items; by tickets the first wave's), and
    with STATIC for its next items' while it works on the current ones."""
    n_gate_up = tl.cdiv(F, GU_N)
    n_slices = F // SLICE
    n_out = tl.cdiv(D, DN_N)
    n_items = XPRO + n_gate_up + n_slices * n_out
    flag = READY + n_slices + n_out  # the prologue's
    if PREFETCH:  # weights depend on no kernel: the first items stream while the previous kernel ends (ticket
        # order: the first wave's items, whichever program takes each; static: this program's own)
        for k in tl.static_range(TICKETS):
            _prefetch_item(tl.program_id(0) * TICKETS + k - XPRO, gu_ptr, gu_s_ptr, gu_m_ptr, dn_ptr, stride_gu_w,
                           stride_gu_g, stride_dn_w, F, D, n_gate_up, n_items - XPRO, n_out, GU_N, SLICE, DN_N,
                           THREADS)  # fmt: skip
    _wait_for_previous_kernel(PDL)
    if STATIC:
        item = tl.program_id(0) * TICKETS
    else:
        item = tl.atomic_add(sync_ptr + TICKET, TICKETS, sem="relaxed")
    while item < n_items:
        # A program runs its items in ascending order, so the smallest unfinished item is always running
        # and everything it waits on is done: no deadlock while every program is resident.
        if PREFETCH and STATIC:  # the next items this program takes into L2 while it works on these
            for k in tl.static_range(TICKETS):
                _prefetch_item(item + n_programs * TICKETS + k - XPRO, gu_ptr, gu_s_ptr, gu_m_ptr, dn_ptr, stride_gu_w,
                               stride_gu_g, stride_dn_w, F, D, n_gate_up, n_items - XPRO, n_out, GU_N, SLICE, DN_N,
                               THREADS)  # fmt: skip
        for k in tl.static_range(TICKETS):
            it = item + k - XPRO
            if XPRO:
                if it < 0:
                    _x_prologue(x_ptr, stride_xm, nw_ptr, eps, xn_ptr, sync_ptr, flag, M, D, ROWS, BLOCK, 4)
            if it >= 0 and it < n_gate_up:
                _gate_up_item(it, x_ptr, stride_xm, nw_ptr, eps, gu_ptr, gu_s_ptr, gu_m_ptr, stride_gu_w, stride_gu_g,
                              h_ptr, stride_hm, sync_ptr, M, F, D, xn_ptr, flag, nibble_mask, GROUP, BLOCK, ROWS,
                              GU_N, GU_B, SLICE, XPRO, MASK_ARG, H32)  # fmt: skip
            elif it >= n_gate_up and it < n_items - XPRO:
                d = it - n_gate_up  # slice-major: the earliest slices' items come first
                _down_item(d // n_out, d % n_out, h_ptr, stride_hm, dn_ptr, dn_s_ptr, dn_m_ptr, stride_dn_w,
                           stride_dn_g, acc_ptr, out_ptr, stride_om, res_ptr, stride_rm, sync_ptr, M, F, D, n_slices,
                           nibble_mask, GROUP, BLOCK, ROWS, GU_N, SLICE, DN_N, RESIDUAL, MASK_ARG)  # fmt: skip
        if STATIC:
            item += n_programs * TICKETS
        else:
            item = tl.atomic_add(sync_ptr + TICKET, TICKETS, sem="relaxed")
    # The last program out finds every item done and resets the counters for the next launch (or replay).
    if tl.atomic_add(sync_ptr + EXITS, 1, sem="acq_rel") == n_programs - 1:
        for i in range(0, n_slices):
            tl.atomic_xchg(sync_ptr + READY + i, 0, sem="relaxed")
        if XPRO:
            tl.atomic_xchg(sync_ptr + flag, 0, sem="relaxed")
        tl.atomic_xchg(sync_ptr + TICKET, 0, sem="relaxed")
        tl.atomic_xchg(sync_ptr + EXITS, 0, sem="release")
