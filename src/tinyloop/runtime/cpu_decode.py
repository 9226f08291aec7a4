"""The CPU decode step: one new token per row, in few torch ops and preallocated buffers; and the prefill of
one row's prompt (up to PREFILL_MAX_TOKENS, each token a row of the same ops, attending causally).

A CPU decode step of a small looped model is bound by per-op overhead as much as by reading the
weights (36 layer passes per token for the built-in model). The model's forward (model/looped.py) runs
over `_CpuOps`, a backend that works on [B, d] rows with about 22 ops per layer: matmuls write into
buffers or add the residual in place (addmm_), RMSNorm is one layer_norm over [x, -x] (mean 0, variance
mean(x^2)), RoPE rotates q and k together, and attention reads per-slot cache views that are rebuilt only
when the attended span grows by a bucket. The injection adapter is split so that its prelude half runs once per token.
Matrices the loader kept as INT4 (bfloat16 matmuls, kernels/cpu_int4.py) go through torch's CPU INT4
kernel, which reads their 4-bit codes instead of a float32 copy; everything else stays float32.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyloop.cache.dense import DenseKVCache
from tinyloop.cache.kv import KVCache
from tinyloop.cache.memory import available_host_bytes
from tinyloop.config import ArchConfig
from tinyloop.kernels import cpu_int4, cpu_onednn
from tinyloop.kernels.cpu_onednn import OneDnnMatrix
from tinyloop.kernels.dispatch import Weight
from tinyloop.log import detail
from tinyloop.model.looped import ForwardOutput, run
from tinyloop.model.ops import gate_logit
from tinyloop.model.weights import LayerWeights, ModelWeights, Norm
from tinyloop.quant import CpuInt4Weight
from tinyloop.runtime.decode_path import StepInput

# Caches whose `update` is the plain positional write this decoder performs itself.
_PLAIN_UPDATES = (KVCache.update, DenseKVCache.update)
# Rows up to this count run on one thread, as the engine's generic path does for small steps.
SINGLE_THREAD_ROWS = 8
# The attended span grows in steps of this many positions (masked past each row's length).
SPAN_BUCKET = 16
# Longer prompts (whose [heads, tokens, span] scores would be large) take the generic forward's attention.
PREFILL_MAX_TOKENS = 256


# A matrix as the decoder multiplies with it: float32 in oneDNN's layout, dense [in, out] where torch has no
# oneDNN (see _mm_operand), or INT4 in the CPU kernel's layout.
Matrix = torch.Tensor | OneDnnMatrix | CpuInt4Weight


def supports(cfg: ArchConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype) -> bool:
    """Float32 on CPU with dense float32 matrices (the CPU loader dequantizes INT4/INT8 at load) or INT4 ones
    in the CPU kernel's layout (what the loader makes of INT4 for bfloat16 matmuls)."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    layers = (*weights.prelude, *weights.body, *weights.coda)
    mats = [m for lw in layers for m in lw.matrices()]
    mats += [m for m in (weights.embed, weights.head, weights.adapter) if m is not None]
    return all(isinstance(m, CpuInt4Weight) or (isinstance(m, torch.Tensor) and m.dtype == torch.float32) for m in mats)


def _mm_operand(w: object, onednn: bool) -> Matrix:
    """w ([out, in]) as the decoder multiplies with it: reordered for oneDNN (a copy), or, without it, as the
    [in, out] right operand of torch.mm in the memory layout one row streams fastest: input-major when
    out >= in, output-major when in > out (1.6x for 1024 -> 384 on an AVX2 CPU; the CPU loader already
    stores matrices so, so this copies nothing). INT4 stays as is."""
    if isinstance(w, CpuInt4Weight):
        return w
    assert isinstance(w, torch.Tensor)
    if onednn:
        return cpu_onednn.pack(w)
    return w.t().contiguous() if w.shape[0] >= w.shape[1] else w.contiguous().t()


def _float32_matrix_bytes(weights: ModelWeights) -> int:
    layers = (*weights.prelude, *weights.body, *weights.coda)
    mats = [m for lw in layers for m in lw.matrices()] + [weights.head, weights.adapter]
    return sum(m.numel() * 4 for m in mats if isinstance(m, torch.Tensor))


def _fits_twice(nbytes: int) -> bool:
    """Whether a copy of nbytes takes at most half the host's available memory."""
    free = available_host_bytes()
    return free is None or 2 * nbytes <= free


def _input_columns(w: object, start: int, stop: int) -> torch.Tensor | CpuInt4Weight:
    """The [out, stop - start] matrix of inputs start..stop of w."""
    if isinstance(w, CpuInt4Weight):
        return cpu_int4.input_columns(w, start, stop)
    assert isinstance(w, torch.Tensor)
    return w[:, start:stop]


@dataclass(frozen=True)
class _NormPack:
    weight: torch.Tensor  # rmsnorm: [2d] = [w, w], applied to [x, -x]; layernorm: [d]
    bias: torch.Tensor | None


@dataclass(frozen=True)
class _LayerPack:
    attn_norm: _NormPack
    attn_post_norm: _NormPack | None
    qkv: Matrix  # [d, q + 2 kv]
    qkv_bias: torch.Tensor | None  # q and k biases, zeros for v
    out: Matrix  # [q, d]
    mlp_norm: _NormPack
    mlp_post_norm: _NormPack | None
    gate_up: Matrix | None  # [d, 2 ffn]
    up: Matrix | None  # [d, ffn]
    down: Matrix  # [ffn, d]


class _Buffers:
    """Work tensors for one batch size, and the matmuls that use them. x2: two ping-pong residual buffers
    [B, 2d] holding [x, -x]."""

    def __init__(self, cfg: ArchConfig, B: int) -> None:
        d, H, KVH, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.x2 = [torch.zeros(B, 2 * d), torch.zeros(B, 2 * d)]
        self.left = [x[:, :d] for x in self.x2]
        self.right = [x[:, d:] for x in self.x2]
        self.tmp2 = torch.zeros(B, 2 * d)  # post-norm inputs of sandwich layers
        self.qkv = torch.empty(B, cfg.q_dim + 2 * cfg.kv_dim)
        pairs = (2, hd // 2) if cfg.rope_pairing == "half" else (hd // 2, 2)
        self.qk4 = self.qkv[:, : cfg.q_dim + cfg.kv_dim].view(B, H + KVH, *pairs)
        self.v = self.qkv[:, cfg.q_dim + cfg.kv_dim :].view(B, KVH, hd)
        self.rot = torch.empty(B, H + KVH, hd)
        self.rot4 = self.rot.view(B, H + KVH, *pairs)
        self.k = self.rot[:, H:]
        self.q3 = self.rot[:, :H].view(B * KVH, H // KVH, hd) if B == 1 else None
        self.attn = torch.empty(B * KVH, H // KVH, hd)
        self.attn2 = self.attn.view(B, cfg.q_dim)
        f = cfg.ffn_dim
        self.gu = torch.empty(B, 2 * f)
        self.gate, self.up = self.gu[:, :f], self.gu[:, f:]
        self.act = torch.empty(B, f)
        self._bf16: dict[torch.Size, torch.Tensor] = {}  # inputs of INT4 matmuls, by shape

    def _int4_input(self, x: torch.Tensor) -> torch.Tensor:
        """x in a preallocated bfloat16 buffer of its shape (copy_ costs a third of .to())."""
        staged = self._bf16.get(x.shape)
        if staged is None:
            staged = self._bf16[x.shape] = torch.empty(x.shape, dtype=torch.bfloat16)
        return staged.copy_(x)

    def product(self, x: torch.Tensor, w: Matrix) -> torch.Tensor:
        """x [B, in] @ w, a new float32 tensor."""
        if isinstance(w, OneDnnMatrix):
            return cpu_onednn.matmul(x, w)
        if isinstance(w, CpuInt4Weight):
            return cpu_int4.matmul(self._int4_input(x), w).float()
        return torch.mm(x, w)

    def product_into(self, out: torch.Tensor, x: torch.Tensor, w: Matrix, plus: torch.Tensor | None = None) -> None:
        """out = x @ w (+ plus)."""
        if isinstance(w, OneDnnMatrix):
            out.copy_(cpu_onednn.matmul(x, w) if plus is None else cpu_onednn.matmul_add(x, w, plus))
        elif isinstance(w, CpuInt4Weight):
            y = cpu_int4.matmul(self._int4_input(x), w)
            if plus is None:
                out.copy_(y)
            else:
                torch.add(y, plus, out=out)
        elif plus is None:
            torch.mm(x, w, out=out)
        else:
            torch.addmm(plus, x, w, out=out)

    def accumulate(self, acc: torch.Tensor, x: torch.Tensor, w: Matrix) -> None:
        """acc += x @ w."""
        if isinstance(w, OneDnnMatrix):
            acc.copy_(cpu_onednn.matmul_add(x, w, acc))
        elif isinstance(w, CpuInt4Weight):
            acc.add_(cpu_int4.matmul(self._int4_input(x), w))
        else:
            acc.addmm_(x, w)


@dataclass
class _CacheViews:
    """Per-slot [B*KVH, hd, span] keys (transposed) and [B*KVH, span, hd] values of one cache."""

    k: torch.Tensor
    v: torch.Tensor
    span: int
    keys_t: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class _Step:
    """What every layer pass of one step shares."""

    rows: torch.Tensor  # [B]
    pos: torch.Tensor  # [B] the new token's position in each row (a prefill: [T], each token's)
    k_at: torch.Tensor | None  # cache.k[:, :, :, p] when every row writes position p, else None
    v_at: torch.Tensor | None
    cos4: torch.Tensor  # [B, H + KVH, hd] as rot4's shape; the q part carries the 1/sqrt(hd) scale
    sin4: torch.Tensor  # signed: x * cos + swap_halves(x) * sin is the rotation
    # Additive, 0 up to each row's position and -inf after: [B * KVH, 1, span]; a prefill's [1, T * G, span]
    # (G query heads per KV head).
    mask: torch.Tensor
    views: _CacheViews
    prefill: bool = False  # the rows are T tokens of cache row 0, from position pos[0] on


class CpuDecoder:
    """Decode steps (T = 1) and, with float32 matrices, one row's prefill (B = 1, T <= PREFILL_MAX_TOKENS) on CPU,
    appended after what the cache holds; anything else is declined (None)."""

    def __init__(self, cfg: ArchConfig, weights: ModelWeights, cos: torch.Tensor, sin: torch.Tensor,
                 noise: torch.Tensor | None, onednn: bool | None = None) -> None:  # fmt: skip
        """onednn: multiply float32 matrices through oneDNN on a reordered copy (kernels/cpu_onednn.py);
        None (the engine's choice): where torch has oneDNN and the copy fits; False: torch.mm."""
        self.cfg = cfg
        self.w = weights
        self.cos, self.sin, self.noise = cos, sin, noise
        copy_bytes = _float32_matrix_bytes(weights)
        layers = (*weights.prelude, *weights.body, *weights.coda)
        matrices = [m for lw in layers for m in lw.matrices()] + [weights.head, weights.adapter]
        self.int4_products = any(isinstance(m, CpuInt4Weight) for m in matrices)
        if onednn is None:
            onednn = cpu_onednn.available() and copy_bytes > 0 and _fits_twice(copy_bytes)
        self.onednn = onednn
        if self.onednn:
            detail(f"CPU decode path: oneDNN copies of the float32 matrices, {copy_bytes / 2**20:.1f} MiB")
        # What the forward hands the ops (a layer's weights, a matrix, a norm) -> its packed form here.
        self.packs: dict[int, _LayerPack] = {}
        self.operands: dict[int, Matrix] = {}
        self.norms: dict[int, _NormPack] = {}
        for lw in (*weights.prelude, *weights.body, *weights.coda):
            pack = self.packs[id(lw)] = self._pack(lw)
            self.operands[id(lw.out)], self.operands[id(lw.down)] = pack.out, pack.down
            for n, packed in ((lw.attn_post_norm, pack.attn_post_norm), (lw.mlp_post_norm, pack.mlp_post_norm)):
                if n is not None and packed is not None:
                    self.norms[id(n)] = packed
        d = cfg.d_model
        self.adapter_state: Matrix | None = None
        self.adapter_prelude: Matrix | None = None
        if weights.adapter is not None:
            # The adapter reads cat(state, prelude_out): split by input half.
            self.adapter_state = _mm_operand(_input_columns(weights.adapter, 0, d), self.onednn)
            self.adapter_prelude = _mm_operand(_input_columns(weights.adapter, d, 2 * d), self.onednn)
        embed, head = weights.embed, weights.head
        embed = embed.dense if isinstance(embed, CpuInt4Weight) else embed
        assert isinstance(embed, torch.Tensor) and isinstance(head, torch.Tensor | CpuInt4Weight)
        self.embed: torch.Tensor = embed
        # Without oneDNN, [d, V] as a view: the tied table stays row-major for lookups.
        self.head: Matrix
        if isinstance(head, torch.Tensor) and not self.onednn:
            self.head = head.t()
        else:
            self.head = _mm_operand(head, self.onednn)
        final_norm = self._norm_pack(weights.final_norm)
        if weights.final_norm is not None and final_norm is not None:
            self.norms[id(weights.final_norm)] = final_norm
        half = cfg.head_dim // 2
        self._pairs = (2, half) if cfg.rope_pairing == "half" else (half, 2)
        self._swap_dim = 2 if cfg.rope_pairing == "half" else 3
        self._q_scale = torch.ones(cfg.n_heads + cfg.n_kv_heads, 1)
        self._q_scale[: cfg.n_heads] = cfg.head_dim**-0.5
        self._buffers: dict[int, _Buffers] = {}
        self._views: weakref.WeakKeyDictionary[KVCache, _CacheViews] = weakref.WeakKeyDictionary()

    # ---- weights ---------------------------------------------------------------------------------
    def _norm_pack(self, n: Norm | None) -> _NormPack | None:
        if n is None:
            return None
        w = n.weight.float()
        if self.cfg.norm_kind == "rmsnorm":
            return _NormPack(torch.cat((w, w)), None)
        return _NormPack(w.contiguous(), None if n.bias is None else n.bias.float().contiguous())

    def _pack(self, lw: LayerWeights) -> _LayerPack:
        cfg = self.cfg
        bias = None
        if lw.q_bias is not None and lw.k_bias is not None:
            bias = torch.cat((lw.q_bias.float(), lw.k_bias.float(), torch.zeros(cfg.kv_dim)))
        attn_norm, mlp_norm = self._norm_pack(lw.attn_norm), self._norm_pack(lw.mlp_norm)
        assert attn_norm is not None and mlp_norm is not None
        return _LayerPack(
            attn_norm=attn_norm,
            attn_post_norm=self._norm_pack(lw.attn_post_norm),
            qkv=_mm_operand(lw.qkv, self.onednn),
            qkv_bias=bias,
            out=_mm_operand(lw.out, self.onednn),
            mlp_norm=mlp_norm,
            mlp_post_norm=self._norm_pack(lw.mlp_post_norm),
            gate_up=None if lw.gate_up is None else _mm_operand(lw.gate_up, self.onednn),
            up=None if lw.up is None else _mm_operand(lw.up, self.onednn),
            down=_mm_operand(lw.down, self.onednn),
        )

    # ---- per step --------------------------------------------------------------------------------
    def _cache_views(self, cache: KVCache, span: int) -> _CacheViews:
        views = self._views.get(cache)
        if views is not None and views.k is cache.k and views.v is cache.v and views.span == span:
            return views
        B, KVH, hd = cache.batch, self.cfg.n_kv_heads, self.cfg.head_dim
        n = cache.k.shape[0]
        keys_t = [cache.k[i, :, :, :span].view(B * KVH, span, hd).transpose(1, 2) for i in range(n)]
        values = [cache.v[i, :, :, :span].view(B * KVH, span, hd) for i in range(n)]
        views = _CacheViews(cache.k, cache.v, span, keys_t, values)
        self._views[cache] = views
        return views

    def _step(self, cache: KVCache, B: int) -> _Step:
        cfg = self.cfg
        KVH = cfg.n_kv_heads
        pos = cache.lengths.clone()
        first, last = int(pos.min()), int(pos.max())
        span = self._span(cache, last + 1)
        cos4, sin4 = self._rope(pos)
        mask = torch.zeros(B, span).masked_fill_(torch.arange(span)[None, :] > pos[:, None], float("-inf"))
        mask = mask[:, None, None, :].expand(B, KVH, 1, span).reshape(B * KVH, 1, span)
        uniform = first == last
        return _Step(
            rows=torch.arange(B),
            pos=pos,
            k_at=cache.k.select(3, first) if uniform else None,
            v_at=cache.v.select(3, first) if uniform else None,
            cos4=cos4,
            sin4=sin4,
            mask=mask,
            views=self._cache_views(cache, span),
        )

    def _prefill_step(self, cache: KVCache, start: int, T: int) -> _Step:
        """T tokens of cache row 0 from position `start` on, each attending to the positions up to its own."""
        G = self.cfg.n_heads // self.cfg.n_kv_heads
        pos = torch.arange(start, start + T)
        span = self._span(cache, start + T)
        cos4, sin4 = self._rope(pos)
        mask = torch.zeros(T, span).masked_fill_(torch.arange(span)[None, :] > pos[:, None], float("-inf"))
        mask = mask[:, None, :].expand(T, G, span).reshape(1, T * G, span)
        views = self._cache_views(cache, span)
        return _Step(torch.zeros(T, dtype=torch.long), pos, None, None, cos4, sin4, mask, views, prefill=True)

    @staticmethod
    def _span(cache: KVCache, end: int) -> int:
        return min(cache.max_seq, -(-end // SPAN_BUCKET) * SPAN_BUCKET)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos4, sin4) of _Step for rows at positions pos."""
        cfg = self.cfg
        cos, sin = self.cos[pos], self.sin[pos]  # [N, hd/2]
        if cfg.rope_pairing == "half":
            c, s = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        else:
            c, s = torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)
        shape = (pos.shape[0], cfg.n_heads + cfg.n_kv_heads, *self._pairs)
        return (c[:, None, :] * self._q_scale).view(shape), (s[:, None, :] * self._q_scale).view(shape)

    # ---- layer pieces ----------------------------------------------------------------------------
    def _norm(self, buf: _Buffers, i: int, n: _NormPack) -> torch.Tensor:
        """The norm of the rows in buffer i ([B, d], fresh)."""
        cfg = self.cfg
        if cfg.norm_kind == "rmsnorm":
            torch.neg(buf.left[i], out=buf.right[i])
            return F.layer_norm(buf.x2[i], (2 * cfg.d_model,), n.weight, None, cfg.norm_eps)[:, : cfg.d_model]
        return F.layer_norm(buf.left[i], (cfg.d_model,), n.weight, n.bias, cfg.norm_eps)

    def _norm_tmp(self, buf: _Buffers, n: _NormPack) -> torch.Tensor:
        """The norm of the rows in buf.tmp2's left half (sandwich post-norms)."""
        d = self.cfg.d_model
        if self.cfg.norm_kind == "rmsnorm":
            torch.neg(buf.tmp2[:, :d], out=buf.tmp2[:, d:])
            return F.layer_norm(buf.tmp2, (2 * d,), n.weight, None, self.cfg.norm_eps)[:, :d]
        return F.layer_norm(buf.tmp2[:, :d], (d,), n.weight, n.bias, self.cfg.norm_eps)

    def _qkv_rope(self, h: torch.Tensor, lp: _LayerPack, st: _Step, buf: _Buffers) -> None:
        """buf.qkv = h @ qkv, and RoPE on its q and k into buf.rot4."""
        buf.product_into(buf.qkv, h, lp.qkv, lp.qkv_bias)
        swapped = buf.qk4.flip(self._swap_dim)
        torch.mul(buf.qk4, st.cos4, out=buf.rot4)
        buf.rot4.addcmul_(swapped, st.sin4)  # RoPE on q and k: x * cos + swap_halves(x) * (-sin, sin)

    def _store_new_kv(self, cache: KVCache, slot: int, st: _Step, buf: _Buffers) -> None:
        """A one-token step's new keys and values into the cache at each row's position."""
        if st.k_at is not None and st.v_at is not None:
            st.k_at[slot].copy_(buf.k)
            st.v_at[slot].copy_(buf.v)
        else:
            cache.k[slot][st.rows, :, st.pos] = buf.k
            cache.v[slot][st.rows, :, st.pos] = buf.v

    def _attention(self, h: torch.Tensor, lp: _LayerPack, cache: KVCache, slot: int, st: _Step, buf: _Buffers) -> None:
        """Attention of normalized rows h [B, d] into buf.attn2 ([B, q], before the out projection)."""
        cfg = self.cfg
        self._qkv_rope(h, lp, st, buf)
        B, KVH = h.shape[0], cfg.n_kv_heads
        if st.prefill:
            start = int(st.pos[0])
            cache.k[slot][0, :, start : start + B] = buf.k.transpose(0, 1)
            cache.v[slot][0, :, start : start + B] = buf.v.transpose(0, 1)
            G, hd = cfg.n_heads // KVH, cfg.head_dim
            q = buf.rot[:, : cfg.n_heads].view(B, KVH, G, hd).transpose(0, 1).reshape(KVH, B * G, hd)
            scores = torch.baddbmm(st.mask, q, st.views.keys_t[slot])
            out = torch.bmm(torch.softmax(scores, dim=-1), st.views.values[slot])  # [KVH, T * G, hd]
            buf.attn.view(B, KVH, G, hd).copy_(out.view(KVH, B, G, hd).transpose(0, 1))
            return
        self._store_new_kv(cache, slot, st, buf)
        q = buf.q3 if buf.q3 is not None else buf.rot[:, : cfg.n_heads].reshape(B * KVH, -1, cfg.head_dim)
        scores = torch.baddbmm(st.mask, q, st.views.keys_t[slot])
        torch.bmm(torch.softmax(scores, dim=-1), st.views.values[slot], out=buf.attn)

    # ---- the step --------------------------------------------------------------------------------
    def release(self) -> None:
        self._buffers.clear()
        self._views = weakref.WeakKeyDictionary()

    def decode(self, step: StepInput, cache: KVCache | None) -> ForwardOutput | None:
        """One new token per row appended after the cache, or one row's tokens at `start` (a prompt, or
        positions recomputed deeper from a resumed state: verification); everything else is declined."""
        tokens, start, resume = step.tokens, step.start, step.resume
        B, T = tokens.shape
        if cache is None or type(cache).update not in _PLAIN_UPDATES or cache.batch != B or step.ragged():
            return None
        appended = bool((start == cache.lengths).all())
        one_token_rows = T == 1 and appended and resume is None
        # bfloat16 matmuls (cpu_int4.matmul) switch kernels past INT4_MAX_ROWS rows, and the two round
        # differently: a prompt prefilled here alone would part from the same prompt prefilled in a batch (the
        # generic path). A resumed forward (verification) has no batched counterpart, and up to that many rows
        # it multiplies with the one-row steps' kernel.
        int4_kernel_fits = not self.int4_products or (resume is not None and T <= cpu_int4.INT4_MAX_ROWS)
        if not one_token_rows and (
            B != 1 or T > PREFILL_MAX_TOKENS or not int4_kernel_fits or start[0] > cache.lengths[0]
        ):
            return None
        previous = torch.get_num_threads()
        single = B * T <= (SINGLE_THREAD_ROWS if one_token_rows else PREFILL_MAX_TOKENS) and previous != 1
        if single:
            torch.set_num_threads(1)
        try:
            # Buffers hold B * T rows either way. Decode steps and verify passes come in few sizes and every
            # round, so theirs are kept; prompts come in many lengths, so theirs are not.
            buf = self._buffers.get(B * T)
            if buf is None:
                buf = _Buffers(self.cfg, B * T)
                if one_token_rows or resume is not None:
                    self._buffers[B * T] = buf
            st = self._step(cache, B) if one_token_rows else self._prefill_step(cache, int(start[0]), T)
            ops = _CpuOps(self, buf, st, cache, T, step.last_only)
            flat_tokens = tokens.to("cpu", torch.long).view(B * T)
            return run(ops, self.w, self.cfg, flat_tokens, step.loops, resume=resume)
        finally:
            if single:
                torch.set_num_threads(previous)


class _CpuOps:
    """ForwardOps (model/ops.py) of one CPU decode step. The residual stream lives in the ping-pong buffers
    [B, 2d] ([x, -x], so RMSNorm is one layer_norm); `cur` is the one holding it. Every op the forward calls
    reads the stream from there and leaves its result there, so values are that buffer (or a scratch buffer
    the next op consumes); `keep` copies what the forward reads later."""

    def __init__(self, dec: CpuDecoder, buf: _Buffers, st: _Step, cache: KVCache, T: int, last_only: bool) -> None:
        self.dec, self.buf, self.st, self.cache = dec, buf, st, cache
        self.T = T  # tokens per batch row (a prefill's row holds them all)
        self.B = st.pos.shape[0] // T
        self.last_only = last_only
        self.cur = 0
        self.injected: torch.Tensor | None = None  # prelude_out's half of the adapter, once per step
        self.zero_state = False  # the state is the zero start (its half of the adapter adds exactly 0)

    def embed(self, tokens: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.mul(F.embedding(tokens, self.dec.embed), scale, out=self.buf.left[self.cur])

    def attention(
        self, x: torch.Tensor, lw: LayerWeights, slot: int, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        dec, buf = self.dec, self.buf
        lp = dec.packs[id(lw)]
        dec._attention(dec._norm(buf, self.cur, lp.attn_norm), lp, self.cache, slot, self.st, buf)
        return self.project(buf.attn2, lw.out, residual)

    def project(
        self, h: torch.Tensor, w: Weight, residual: torch.Tensor | None = None, *, into_residual: bool = False
    ) -> torch.Tensor:
        operand = self.dec.operands[id(w)]
        if residual is None:  # a sandwich sublayer's output, normalized next (post_norm)
            out = self.buf.tmp2[:, : self.dec.cfg.d_model]
            self.buf.product_into(out, h, operand)
            return out
        self.buf.accumulate(residual, h, operand)
        return residual

    def post_norm(self, y: torch.Tensor, n: Norm, residual: torch.Tensor, *, sum_first: bool) -> torch.Tensor:
        packed = self.dec.norms[id(n)]
        if sum_first:
            residual.add_(y)
            return residual.copy_(self.dec._norm(self.buf, self.cur, packed))
        return residual.add_(self.dec._norm_tmp(self.buf, packed))

    def mlp(self, x: torch.Tensor, lw: LayerWeights, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.project(self.mlp_in(x, lw), lw.down, residual, into_residual=residual is not None)

    def mlp_in(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        dec, buf = self.dec, self.buf
        lp = dec.packs[id(lw)]
        h = dec._norm(buf, self.cur, lp.mlp_norm)
        if lp.gate_up is not None:
            buf.product_into(buf.gu, h, lp.gate_up)
            F.silu(buf.gate, inplace=True)
            return torch.mul(buf.gate, buf.up, out=buf.act)
        assert lp.up is not None
        return F.gelu(buf.product(h, lp.up))

    def norm(self, x: torch.Tensor, n: Norm) -> torch.Tensor:
        return x.copy_(self.dec._norm(self.buf, self.cur, self.dec.norms[id(n)]))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.cur = 1 - self.cur
        return torch.add(a, b, out=self.buf.left[self.cur])

    def concat_project(self, state: torch.Tensor, prelude_out: torch.Tensor, adapter: Weight) -> torch.Tensor:
        dec, buf = self.dec, self.buf
        assert dec.adapter_state is not None and dec.adapter_prelude is not None
        if self.injected is None:
            self.injected = buf.product(prelude_out, dec.adapter_prelude)
        self.cur = 1 - self.cur
        if self.zero_state:
            self.zero_state = False
            return buf.left[self.cur].copy_(self.injected)
        buf.product_into(buf.left[self.cur], state, dec.adapter_state, self.injected)
        return buf.left[self.cur]

    def zeros_state(self, like: torch.Tensor) -> torch.Tensor:
        self.zero_state = True
        return like.zero_()

    def noise_state(self, like: torch.Tensor) -> torch.Tensor:
        assert self.dec.noise is not None
        return like.copy_(self.dec.noise[self.st.pos])

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def gate(self, state: torch.Tensor) -> torch.Tensor:
        return gate_logit(self.dec.w, state[:, None, :]).view(self.B, self.T)

    def head(self, x: torch.Tensor, n: Norm | None, scale: float) -> torch.Tensor:
        dec = self.dec
        if n is not None:
            x = dec._norm(self.buf, self.cur, dec.norms[id(n)])
        if self.last_only and self.T > 1:
            x = x[-1:]
        logits = self.buf.product(x, dec.head)
        if scale != 1.0:
            logits.mul_(scale)
        return logits.view(self.B, -1, logits.shape[-1])

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(self.B, self.T, -1)

    def where_rows(self, take_new: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return new.copy_(torch.where(take_new.view(-1, 1), new, old))

    def resume(self, state: torch.Tensor, prelude_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.B * self.T
        return self.buf.left[self.cur].copy_(state.reshape(rows, -1)), prelude_out.reshape(rows, -1)
