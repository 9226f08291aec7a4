"""Triton kernels for attention over the static KV cache: RoPE + cache write, and cached attention.

Cache layout (cache/kv.py): [slots, B, kv_heads, max_seq, head_dim]; rows of this step are
(b, t) pairs flattened to i = b * T + t, with absolute position pos[i].
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyloop.kernels.triton_pdl import _wait_for_previous_kernel


@triton.jit
def _rope_pairs(HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Indices of the rotated pairs (x[idx1], x[idx2]) and of their frequencies (half)."""
    half = tl.arange(0, HEAD_DIM // 2)
    if INTERLEAVED:
        idx1 = 2 * half
        idx2 = 2 * half + 1
    else:
        idx1 = half
        idx2 = half + HEAD_DIM // 2
    return half, idx1, idx2


@triton.jit
def _rotate(x1, x2, c, s):
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _softmax_block(scores, v, m_i, l_i, acc):
    """One online-softmax step over a block of keys: scores [S] (masked ones -inf), values v [S, hd]."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=0))
    p = tl.exp(scores - m_new)
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    rows,
    T,
    stride_qkv,
    stride_cb,
    stride_ch,
    stride_cs,
    N_HEADS: tl.constexpr,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (r, h) takes rows r * BLOCK_R onwards: h < N_HEADS ropes query head h into q_out
    [rows, H, hd]; the next N_KV programs rope key heads into the cache, the last N_KV copy value heads
    into it. Blocks of rows rather than one row per program: a long prefill otherwise launches tens of
    thousands of one-warp programs, each waiting on its own chain of dependent loads (H200, 1,024 tokens
    of seed-407m: 60 us per layer with one row per program)."""
    _wait_for_previous_kernel(PDL)
    h = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = i < rows
    b = i // T
    pos = tl.load(pos_ptr + i, mask=live, other=0)
    half, idx1, idx2 = _rope_pairs(HEAD_DIM, INTERLEAVED)
    row = qkv_ptr + i[:, None] * stride_qkv
    mask = live[:, None]
    if h < N_HEADS + N_KV:
        base = row + h * HEAD_DIM  # q heads then k heads are contiguous in qkv
        x1 = tl.load(base + idx1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + idx2[None, :], mask=mask, other=0.0).to(tl.float32)
        freq = pos[:, None] * (HEAD_DIM // 2) + half[None, :]
        c = tl.load(cos_ptr + freq, mask=mask, other=0.0)
        s = tl.load(sin_ptr + freq, mask=mask, other=0.0)
        y1, y2 = _rotate(x1, x2, c, s)
        if h < N_HEADS:
            dst = q_out_ptr + (i[:, None] * N_HEADS + h) * HEAD_DIM
        else:
            dst = k_cache_ptr + b[:, None] * stride_cb + (h - N_HEADS) * stride_ch + pos[:, None] * stride_cs
        dt = dst.dtype.element_ty
        tl.store(dst + idx1[None, :], y1.to(dt), mask=mask)
        tl.store(dst + idx2[None, :], y2.to(dt), mask=mask)
    else:
        kv = h - N_HEADS - N_KV
        offs = tl.arange(0, HEAD_DIM)[None, :]
        v = tl.load(row + (N_HEADS + N_KV + kv) * HEAD_DIM + offs, mask=mask)
        dst = v_cache_ptr + b[:, None] * stride_cb + kv * stride_ch + pos[:, None] * stride_cs
        tl.store(dst + offs, v.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _cached_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pos_ptr,
    out_ptr,
    T,
    scale,
    stride_cb,
    stride_ch,
    stride_cs,
    N_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (i, h): query head h of row i attends to cache positions 0..pos[i] of its kv head
    (online softmax in float32); out [rows, H * hd]."""
    _wait_for_previous_kernel(PDL)
    i = tl.program_id(0)
    h = tl.program_id(1)
    b = i // T
    kvh = h // GROUP
    length = tl.load(pos_ptr + i) + 1
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (i * N_HEADS + h) * HEAD_DIM + offs_d).to(tl.float32) * scale
    k_base = k_cache_ptr + b * stride_cb + kvh * stride_ch
    v_base = v_cache_ptr + b * stride_cb + kvh * stride_ch
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for s0 in range(0, length, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < length
        k = tl.load(k_base + offs_s[:, None] * stride_cs + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        scores = tl.where(s_mask, scores, float("-inf"))
        v = tl.load(v_base + offs_s[:, None] * stride_cs + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        m_i, l_i, acc = _softmax_block(scores, v, m_i, l_i, acc)
    out = acc / l_i
    tl.store(out_ptr + (i * N_HEADS + h) * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _rotated_halves(x_ptr, idx1, idx2, c, s):
    """The two halves of each rotated pair of the head vector at x_ptr (float32)."""
    return _rotate(tl.load(x_ptr + idx1).to(tl.float32), tl.load(x_ptr + idx2).to(tl.float32), c, s)


@triton.jit
def _rotated(x_ptr, pos, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The head vector at x_ptr rotated to position `pos`, whole ([HEAD_DIM], float32, in its own element
    order): `_rotate` on the pair halves (contiguous loads), joined back."""
    half, idx1, idx2 = _rope_pairs(HEAD_DIM, INTERLEAVED)
    c = tl.load(cos_ptr + pos * (HEAD_DIM // 2) + half)
    s = tl.load(sin_ptr + pos * (HEAD_DIM // 2) + half)
    y1, y2 = _rotated_halves(x_ptr, idx1, idx2, c, s)
    pairs = tl.join(y1, y2)  # [HEAD_DIM / 2, 2]: element (i, 0) is x[idx1[i]], (i, 1) is x[idx2[i]]
    if INTERLEAVED:
        return tl.reshape(pairs, [HEAD_DIM])
    return tl.reshape(tl.permute(pairs, [1, 0]), [HEAD_DIM])


@triton.jit
def _cached_block(k_cache, v_cache, s0, end, stride_cs, idx1, idx2, offs_d, WHOLE_ROWS: tl.constexpr,
                  BLOCK_S: tl.constexpr):  # fmt: skip
    """Cached keys and values at positions s0 .. s0 + BLOCK_S - 1 below `end`, and that mask. Keys (ka, kb) as
    whole rows (one contiguous load each, in the cache's dtype; kb is ka) or as the two halves of each rotated
    pair (float32)."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
    s_mask = offs_s < end
    kp = k_cache + offs_s[:, None] * stride_cs
    if WHOLE_ROWS:
        ka = tl.load(kp + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        kb = ka
    else:
        ka = tl.load(kp + idx1[None, :], mask=s_mask[:, None], other=0.0).to(tl.float32)
        kb = tl.load(kp + idx2[None, :], mask=s_mask[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_cache + offs_s[:, None] * stride_cs + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    return ka, kb, v, s_mask


@triton.jit
def _scores(ka, kb, q1, q2, s_mask, WHOLE_ROWS: tl.constexpr):
    """The query (q1, q2 as `_cached_block` holds keys; q2 unused for whole rows) against a block of keys;
    masked keys -inf."""
    if WHOLE_ROWS:
        scores = tl.sum(ka.to(tl.float32) * q1[None, :], axis=1)
    else:
        scores = tl.sum(ka * q1[None, :], axis=1) + tl.sum(kb * q2[None, :], axis=1)
    return tl.where(s_mask, scores, float("-inf"))


@triton.jit
def _rope_attention_kernel(
    qkv_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    scale,
    stride_qkv,
    stride_cb,
    stride_ch,
    stride_cs,
    N_HEADS: tl.constexpr,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One-token steps in one launch: program (b, h, split) ropes query head h and its kv head's new key,
    attends to its split of cache positions 0..pos-1 (whole blocks of BLOCK_S; the last live split also to
    the new key/value, held in registers), and (split 0, first query head of each kv group) writes the new
    key/value into the cache. No program reads cache position pos, so the write needs no ordering against
    the other programs. The split's first block of cached keys and values is loaded before the wait on the
    previous kernel (the qkv matmul): those positions were written by earlier steps, and the positions by
    the host before the step, so the loads overlap the matmul's tail.

    The splits that pos leaves keys for are live (at least one); the others end at once, so a split count
    chosen for long caches costs short ones nothing. One live split writes the output; several leave their
    running max, sum and weighted values in part_ptr ([B, H, SPLITS, HEAD_DIM + 2] float32) and count
    themselves in count_ptr ([B, H] int32, zero between launches); the live split that counts last merges
    the partial softmaxes, writes the output and zeroes the count again."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + b)
    if SPLITS == 1:
        # Keys as rotation halves: for the few programs of one split per head (narrow heads: the built-in model)
        # whole rows cost the query's regrouping in latency (H100: its one-row step 0.539 against 0.509 ms). Wide
        # heads take this path too where rows alone make enough programs (64 rows of 16 heads: 30.7 us, H100).
        _attend(qkv_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, out_ptr, part_ptr, count_ptr, scale, stride_qkv,
                stride_cb, stride_ch, stride_cs, b, h, pos, 0, 0, pos, 1, N_HEADS, N_KV, HEAD_DIM, INTERLEAVED,
                BLOCK_S, SPLITS, False, PDL)  # fmt: skip
    else:
        split = tl.program_id(2)
        span = tl.maximum(tl.cdiv(tl.cdiv(pos, SPLITS), BLOCK_S), 1) * BLOCK_S
        live = tl.maximum(tl.cdiv(pos, span), 1)
        if split < live:
            lo = split * span
            _attend(qkv_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, out_ptr, part_ptr, count_ptr, scale,
                    stride_qkv, stride_cb, stride_ch, stride_cs, b, h, pos, split, lo, tl.minimum(lo + span, pos), live,
                    N_HEADS, N_KV, HEAD_DIM, INTERLEAVED, BLOCK_S, SPLITS, True, PDL)  # fmt: skip


@triton.jit
def _attend(qkv_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, out_ptr, part_ptr, count_ptr, scale, stride_qkv,
            stride_cb, stride_ch, stride_cs, b, h, pos, split, lo, hi, live, N_HEADS: tl.constexpr, N_KV: tl.constexpr,
            HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
            WHOLE_ROWS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Split `split` (live: one of the first `live`) of `_rope_attention_kernel`'s program (b, h): cached keys lo
    to below hi, the new key with the last live split; keys and the query as whole rows or rotation halves."""
    writes_cache = split == 0 and h % (N_HEADS // N_KV) == 0
    m_i, l_i, acc = _attend_state(qkv_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, scale, stride_qkv, stride_cb,
                                  stride_ch, stride_cs, b, h, pos, lo, hi, split == live - 1, writes_cache, N_HEADS,
                                  N_KV, HEAD_DIM, INTERLEAVED, BLOCK_S, WHOLE_ROWS, PDL)  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM)
    out_row = out_ptr + (b * N_HEADS + h) * HEAD_DIM + offs_d
    if live == 1:
        tl.store(out_row, (acc / l_i).to(out_ptr.dtype.element_ty))
    else:
        _merge_splits(part_ptr, count_ptr + b * N_HEADS + h, (b * N_HEADS + h) * SPLITS, split, live, m_i, l_i,
                      acc, out_row, HEAD_DIM, SPLITS)  # fmt: skip


@triton.jit
def _attend_state(qkv_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, scale, stride_qkv, stride_cb, stride_ch,
                  stride_cs, b, h, pos, lo, hi, holds_new, writes_cache, N_HEADS: tl.constexpr, N_KV: tl.constexpr,
                  HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_S: tl.constexpr, WHOLE_ROWS: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    """Query head h of row b ropes itself and its kv head's new key (`writes_cache`: and stores the new key and
    value at cache position pos), attends to cached keys lo to below hi (and to the new key where `holds_new`),
    and returns its softmax state: running max, sum and weighted values [HEAD_DIM], all float32. The first
    block of cached keys is loaded before the wait on the previous kernel."""
    kvh = h // (N_HEADS // N_KV)
    half, idx1, idx2 = _rope_pairs(HEAD_DIM, INTERLEAVED)
    offs_d = tl.arange(0, HEAD_DIM)
    k_cache = k_cache_ptr + b * stride_cb + kvh * stride_ch
    v_cache = v_cache_ptr + b * stride_cb + kvh * stride_ch
    ka, kb, v, s_mask = _cached_block(k_cache, v_cache, lo, hi, stride_cs, idx1, idx2, offs_d, WHOLE_ROWS, BLOCK_S)
    _wait_for_previous_kernel(PDL)
    row = qkv_ptr + b * stride_qkv
    q_base = row + h * HEAD_DIM
    k_base = row + (N_HEADS + kvh) * HEAD_DIM
    # Rounded to the cache dtype like the two-kernel path (rope_store then attention over the cache).
    dt = k_cache_ptr.dtype.element_ty
    if WHOLE_ROWS:
        k1 = _rotated(k_base, pos, cos_ptr, sin_ptr, HEAD_DIM, INTERLEAVED).to(dt)
        q1 = _rotated(q_base, pos, cos_ptr, sin_ptr, HEAD_DIM, INTERLEAVED)
        q1 = q1.to(qkv_ptr.dtype.element_ty).to(tl.float32) * scale
        k2, q2 = k1, q1
    else:
        c = tl.load(cos_ptr + pos * (HEAD_DIM // 2) + half)
        s = tl.load(sin_ptr + pos * (HEAD_DIM // 2) + half)
        k1, k2 = _rotated_halves(k_base, idx1, idx2, c, s)
        k1, k2 = k1.to(dt), k2.to(dt)
        q1, q2 = _rotated_halves(q_base, idx1, idx2, c, s)
        q1 = q1.to(qkv_ptr.dtype.element_ty).to(tl.float32) * scale
        q2 = q2.to(qkv_ptr.dtype.element_ty).to(tl.float32) * scale
    v_new = tl.load(row + (N_HEADS + N_KV + kvh) * HEAD_DIM + offs_d).to(dt)
    if writes_cache:
        if WHOLE_ROWS:
            tl.store(k_cache + pos * stride_cs + offs_d, k1)
        else:
            tl.store(k_cache + pos * stride_cs + idx1, k1)
            tl.store(k_cache + pos * stride_cs + idx2, k2)
        tl.store(v_cache + pos * stride_cs + offs_d, v_new)
    if WHOLE_ROWS:
        new_score = tl.sum(k1.to(tl.float32) * q1, axis=0)
    else:
        new_score = tl.sum(k1.to(tl.float32) * q1, axis=0) + tl.sum(k2.to(tl.float32) * q2, axis=0)
    # A split without the new key may see no key at all: a finite floor keeps its state 0 instead of NaN.
    m_i = tl.where(holds_new, new_score, -1.0e30)
    l_i = tl.where(holds_new, 1.0, 0.0)
    acc = tl.where(holds_new, v_new.to(tl.float32), 0.0)
    m_i, l_i, acc = _softmax_block(_scores(ka, kb, q1, q2, s_mask, WHOLE_ROWS), v, m_i, l_i, acc)
    for s0 in range(lo + BLOCK_S, hi, BLOCK_S):
        ka, kb, v, s_mask = _cached_block(k_cache, v_cache, s0, hi, stride_cs, idx1, idx2, offs_d, WHOLE_ROWS, BLOCK_S)
        m_i, l_i, acc = _softmax_block(_scores(ka, kb, q1, q2, s_mask, WHOLE_ROWS), v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _merge_splits(part_ptr, count, first, split, live, m_i, l_i, acc, out_row, HEAD_DIM: tl.constexpr,
                  SPLITS: tl.constexpr):  # fmt: skip
    """Leave this split's softmax state at part row first + split; the split that arrives last of the `live`
    ones combines their rows into out_row and resets the arrival count."""
    width: tl.constexpr = HEAD_DIM + 2
    offs_d = tl.arange(0, HEAD_DIM)
    mine = part_ptr + (first + split) * width
    tl.store(mine + offs_d, acc)
    tl.store(mine + HEAD_DIM, m_i)
    tl.store(mine + HEAD_DIM + 1, l_i)
    tl.debug_barrier()  # every thread's part written before the count says so
    arrived = tl.atomic_add(count, 1, sem="acq_rel")
    if arrived == live - 1:
        offs_p = tl.arange(0, SPLITS)
        written = offs_p < live  # rows past `live` hold an earlier launch's states
        rows = part_ptr + (first + offs_p) * width
        m = tl.load(rows + HEAD_DIM, mask=written, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp(m - tl.max(m, axis=0))  # the last live split holds the new key: the max is finite
        total = tl.sum(w * tl.load(rows + HEAD_DIM + 1, mask=written, other=0.0, cache_modifier=".cg"), axis=0)
        parts = tl.load(rows[:, None] + offs_d[None, :], mask=written[:, None], other=0.0, cache_modifier=".cg")
        out = tl.sum(w[:, None] * parts, axis=0) / total
        tl.store(out_row, out.to(out_row.dtype.element_ty))
        tl.atomic_xchg(count, 0)
