"""The CUDA decode step: the model's looped forward (model/looped.py) over the static KV cache with fused
Triton kernels as its ops (`_FusedOps`), captured in CUDA graphs (one per batch size, token count, loop
count and cache, built lazily): the forward's Python runs while capturing, the replay is the kernels alone.

Per layer: RMSNorm + QKV (+ bias) -> RoPE + cache write + cached attention (one launch for one-token
steps, two otherwise) -> output projection + residual -> RMSNorm + gate/up + SwiGLU -> down projection +
residual; five launches instead of ~40, chained by programmatic dependent launch on Hopper.
Same rounding points as the torch ops (tests compare the two); configs it does not cover (LayerNorm) and
ragged batches go back to the generic path.
"""

from __future__ import annotations

import gc
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from tinyloop.cache.kv import KVCache
from tinyloop.kernels import cuda_ops, gluon_int4_mma, l2_residency
from tinyloop.kernels.attention_backend import sdpa
from tinyloop.kernels.cuda_ops import CudaKernels, ProductWeight, dequantize_int4
from tinyloop.kernels.dispatch import Weight, embedding
from tinyloop.kernels.one_token import OneTokenAttention
from tinyloop.log import detail, info
from tinyloop.model.layers import position_mask
from tinyloop.model.looped import ForwardOutput, Resume, run
from tinyloop.model.ops import gate_logit
from tinyloop.model.weights import LayerWeights, Norm
from tinyloop.quant import CudaMmaInt4Weight, CudaTinygemmWeight, Int4Weight
from tinyloop.runtime.decode_path import DecoderHost, StepInput
from tinyloop.stochastic.weight import StochasticInt4Weight

# Steps of up to this many tokens per row attend through the cached-attention kernel; longer steps
# (prefill) use SDPA: its causal flash path from an empty cache, a position mask after earlier tokens.
FUSED_ATTENTION_MAX_TOKENS = 16
# One-token steps rope, write the cache and attend in one launch (cuda_ops.rope_attention).
ROPE_ATTENTION_ONE_KERNEL = True
# Captured graphs kept (least recently used evicted). Speculative decoding alone uses one per draft and
# verify depth plus one per verification length (2 .. 2 x draft_ahead + 1 tokens), and an adaptive draft
# length visits them all: with 8 kept, seed-407m's (2, 8) run on the H200 re-captured graphs every round
# and decoded at 231 tokens/s against 573 plain. The graphs share one memory pool, so each costs little.
MAX_GRAPHS = 32
# Many-row steps (KernelPolicy.dense_copy_min_rows) keep 16-bit copies of the INT4 matrices when they take
# at most this share of the device's memory (seed-407m: 822 MB in bf16; Ouro-1.4B's shape: 2.9 GB); larger
# models dequantize each matrix into scratch before every many-row product.
DENSE_COPY_MAX_FRACTION = 0.125


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    output: ForwardOutput
    resume: Resume | None = None
    nbytes: int = 0  # what the capture left allocated (counted in graph_bytes until evicted)
    windowed: bool = False  # captured with the engine's L2 window: replays make its lines persisting


def _device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the CPU tests' interpreted kernels


def has_cross_iter_weight(m: object) -> bool:
    return isinstance(m, StochasticInt4Weight)


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic collector off inside the block. Run mid-capture, it may free a dead cycle holding another
    model's CUDA graphs, and destroying a graph exec during a capture is forbidden: CUDA invalidates the capture
    (seen on the H200 loading, closing and reloading models; torch no longer collects before a capture)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class FusedDecoder:
    """Decoder (runtime/decode_path.py) for CUDA engines; `graphs=False` runs the kernels eagerly
    (also how the CPU tests drive it under TRITON_INTERPRET=1)."""

    def __init__(self, engine: DecoderHost, graphs: bool = True) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.kernels = CudaKernels(engine.kernel_policy)
        self.graphs_enabled = graphs and engine.device.type == "cuda"
        self._graphs: OrderedDict[tuple[int, ...], _Graph] = OrderedDict()
        self._seen: set[tuple[int, ...]] = set()
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._scratch: KVCache | None = None
        # Whether the persisting L2 share is given up for prefills (l2_residency.SHARE_OFF_DURING_PREFILL).
        self._share_dropped = False
        # Bytes the captured graphs keep allocated (their activations live in a private pool).
        self.graph_bytes = 0
        self._supported = self._kernels_cover()
        w = self.engine.weights
        self._gate_weight = None if w.exit_gate_weight is None else w.exit_gate_weight.float().reshape(1, -1)
        self._gate_bias = None if w.exit_gate_bias is None else w.exit_gate_bias.float().reshape(1)
        adapter = [] if w.adapter is None else [w.adapter]
        matrices = [*adapter, *(m for lw in self._all_layers() for m in lw.matrices()), w.head]
        self._int4_matrices = [m for m in matrices if isinstance(m, Int4Weight)]
        int4_numel = sum(m.shape[0] * m.shape[1] for m in self._int4_matrices)
        budget = DENSE_COPY_MAX_FRACTION * _device_memory_bytes(engine.device)
        self._dense_copies_fit = 0 < int4_numel * engine.dtype.itemsize <= budget
        # id(INT4 matrix) -> its 16-bit copy, made by the first step of dense_copy_min_rows rows.
        self._dense_copies: dict[int, torch.Tensor] = {}
        self.dense_copy_bytes = 0  # counted in vram_usage_mb
        self._tinygemm_fits = engine.device.type == "cuda" and 0 < int4_numel // 2 <= budget
        # id(INT4 matrix) -> it repacked for torch's tinygemm kernel, made by the first small batched step.
        self._tinygemm: dict[int, CudaTinygemmWeight] = {}
        self.tinygemm_bytes = 0  # counted in vram_usage_mb
        # id(INT4 matrix) -> it in the tensor-core INT4 kernel's layout, made by the first batched step it takes.
        self._mma_int4: dict[int, CudaMmaInt4Weight] = {}
        # rows (batch x tokens) -> the copies its tile divides (a step's weights are looked up at least twice).
        self._mma_int4_by_rows: dict[int, dict[int, CudaMmaInt4Weight]] = {}
        self.mma_int4_bytes = 0  # counted in vram_usage_mb
        self._qkv_bias: dict[int, torch.Tensor | None] = {}
        for lw in self._all_layers():
            self._qkv_bias[id(lw)] = self._combined_bias(lw)
        if self.kernels.policy.batch_invariant:
            self._check_batch_invariant(matrices)

    def _check_batch_invariant(self, matrices: list[Weight]) -> None:
        """Batch-invariant mode holds only where every step runs the kernels it fixes: name what this model
        lacks rather than run some steps on others."""
        dtype, policy = self.engine.dtype, self.kernels.policy
        problem = None
        if dtype not in (torch.bfloat16, torch.float16):
            problem = f"bfloat16 or float16 compute (this model computes in {str(dtype).removeprefix('torch.')})"
        elif not self.supported:
            problem = "an RMSNorm model of plain INT4 matrices (not cross-iteration rounding weights)"
        elif not self._tinygemm_fits:
            problem = "room for a copy of the INT4 matrices in the kernel's layout (1/8 of the GPU's memory)"
        for m in matrices:
            if problem is not None:
                break
            if not isinstance(m, Int4Weight):
                problem = f"INT4 matrices (found a 16-bit {tuple(m.shape)} matrix; convert with --bits 4)"
            elif not (CudaMmaInt4Weight.supports(m, dtype) and cuda_ops.mma_int4_applies(policy, m, 1)):
                problem = f"matrices the warpgroup INT4 kernel's tile divides (not {m.shape}, groups of {m.group_size})"
        if problem is not None:
            raise ValueError(f"TINYLOOP_BATCH_INVARIANT=1 needs {problem}")

    def _all_layers(self) -> list[LayerWeights]:
        w = self.engine.weights
        return [*w.prelude, *w.body, *w.coda]

    def _combined_bias(self, lw: LayerWeights) -> torch.Tensor | None:
        if lw.q_bias is None or lw.k_bias is None:
            return None
        v = torch.zeros(self.cfg.kv_dim, dtype=torch.float32, device=lw.q_bias.device)
        return torch.cat((lw.q_bias.float(), lw.k_bias.float(), v))

    @property
    def supported(self) -> bool:
        return self._supported

    def _kernels_cover(self) -> bool:
        """RMSNorm models whose matrices are plain INT4 or 16/32-bit (not e.g. stochastic-rounding weights)."""
        w = self.engine.weights
        mats: list[object] = [w.head, w.adapter] if w.adapter is not None else [w.head]
        for lw in self._all_layers():
            mats += lw.matrices()
        plain = all(isinstance(m, (Int4Weight, torch.Tensor)) and not has_cross_iter_weight(m) for m in mats)
        return self.cfg.norm_kind == "rmsnorm" and plain

    def decode(self, step: StepInput, cache: KVCache | None) -> ForwardOutput | None:
        """Any step over the cache (appended, rewritten at `start`, resumed); without a cache an uncached
        forward from position 0 (scoring), run over a scratch cache kept for reuse."""
        B, T = step.tokens.shape
        if cache is None:
            if bool((step.start != 0).any()):
                return None
            cache = self._scratch_cache(B, T, step.loops)
        if not self.supported:
            return None
        dev = self.engine.device
        # Right-padded rows (a batch of prompts): the padding writes K/V past each row's end, which nothing
        # reads, and the head takes each row's last real token. Such steps run eagerly.
        ragged = step.ragged()
        last_index = None
        if ragged and step.last_only:
            assert step.valid is not None
            last_index = (step.valid.to(dev, torch.long) - 1).clamp_(min=0)
        span = int((step.start + T).max()) if bool((step.start != 0).any()) else None
        positions = (step.start[:, None] + torch.arange(T)[None, :]).reshape(-1)
        # Where the attention tile follows the cache's length, a graph on each side of the policy's threshold.
        long_cache = T == 1 and self.kernels.policy.attends_long_cache(B, int(positions.max()) + 1)
        if l2_residency.SHARE_OFF_DURING_PREFILL and self._rows_on_cublas(B, T):
            self._drop_share()
        resume = None if step.resume is None else step.resume.to(dev, self.engine.dtype)
        if not self.graphs_enabled or T > FUSED_ATTENTION_MAX_TOKENS or ragged:
            # Prefill-sized steps run eagerly: their launches are few against their work, and a continuous
            # batcher's prompt chunks come in ever new lengths, whose captures would evict the decode graphs.
            on_device = replace(step, tokens=step.tokens.to(dev), resume=resume)
            return self._forward(on_device, positions.to(dev), cache, last_index=last_index, span=span,
                                 long_cache=long_cache)  # fmt: skip
        resumed_at = -1 if resume is None else resume.start_loop
        key = (B, T, step.loops, int(step.last_only), resumed_at, int(long_cache), cache.k.data_ptr(), *cache.k.shape)
        entry = self._graphs.get(key)
        if entry is None:
            on_device = replace(step, tokens=step.tokens.to(dev), resume=resume)
            if T > 1 and key not in self._seen:  # a multi-token shape seen once is not worth a graph yet
                self._seen.add(key)
                return self._forward(on_device, positions.to(dev), cache)
            entry = self._capture(on_device, positions, cache, long_cache)
            self._graphs[key] = entry
            if len(self._graphs) > MAX_GRAPHS:
                self.graph_bytes -= self._graphs.popitem(last=False)[1].nbytes
        else:
            self._graphs.move_to_end(key)
        entry.tokens.copy_(step.tokens, non_blocking=True)
        entry.positions.copy_(positions, non_blocking=True)
        if resume is not None and entry.resume is not None:
            entry.resume.copy_(resume)
        if entry.windowed and self._share_dropped:
            self._restore_share()
        entry.graph.replay()
        out = entry.output
        return ForwardOutput(
            logits=None if out.logits is None else out.logits.clone(),
            gates=[g.clone() for g in out.gates],
            loop_state=None if out.loop_state is None else out.loop_state.clone(),
            prelude_out=None if out.prelude_out is None else out.prelude_out.clone(),
        )

    def release(self) -> None:
        self._graphs.clear()
        self._seen.clear()
        self._pool = None
        self._scratch = None
        self.graph_bytes = 0
        self._dense_copies = {}
        self.dense_copy_bytes = 0
        self._tinygemm = {}
        self.tinygemm_bytes = 0
        self._mma_int4 = {}
        self._mma_int4_by_rows = {}
        self.mma_int4_bytes = 0

    def step_weights(self, batch: int, tokens: int) -> Mapping[int, ProductWeight]:
        """What a step of `batch` sequences x `tokens` tokens multiplies in place of the INT4 matrices (by id):
        their tensor-core INT4 copies or tinygemm repacks in batched steps, their 16-bit copies in many-row ones,
        none otherwise."""
        return (
            self.mma_int4_weights(batch, tokens)
            or self.tinygemm_weights(batch, tokens)
            or self.dense_copies(batch, tokens)
        )

    def mma_int4_weights(self, batch: int, tokens: int) -> Mapping[int, ProductWeight]:
        """The INT4 matrices in the tensor-core INT4 kernel's layout (those its tile divides), made on first use,
        for batched one-token steps of as many sequences as the policy's tensor-core range takes, in 16-bit
        compute (and a single sequence's steps of that many tokens with policy.mma_int4_few_tokens); the others
        keep their INT4 kernels."""
        if not self._takes_mma_int4(batch, tokens):
            return {}
        if not self._mma_int4:
            dtype = self.engine.dtype
            copies = {id(m): CudaMmaInt4Weight.from_int4(m, dtype) for m in self._int4_matrices
                      if CudaMmaInt4Weight.supports(m, dtype)}  # fmt: skip
            self.mma_int4_bytes = sum(c.nbytes for c in copies.values())
            mib = self.mma_int4_bytes / 2**20
            info(f"batched steps: INT4 matrices copied for the tensor-core kernel ({mib:.0f} MiB)")
            self._mma_int4 = copies
        rows = batch * tokens
        if self.kernels.policy.batch_invariant:  # one tile at every row count, checked to divide every matrix
            return self._mma_int4
        if rows not in self._mma_int4_by_rows:
            policy = self.kernels.policy
            taken = {key: c for key, c in self._mma_int4.items() if cuda_ops.mma_int4_applies(policy, c, rows)}
            self._mma_int4_by_rows[rows] = taken
        return self._mma_int4_by_rows[rows]

    def _takes_mma_int4(self, batch: int, tokens: int) -> bool:
        policy = self.kernels.policy
        token_count_taken = tokens == 1 or policy.mma_int4_few_tokens or policy.batch_invariant
        fits = self._tinygemm_fits and self.engine.dtype in (torch.bfloat16, torch.float16)
        return token_count_taken and policy.mma_int4_takes_rows(batch * tokens) and fits and gluon_int4_mma.available()

    def tinygemm_weights(self, batch: int, tokens: int) -> dict[int, CudaTinygemmWeight]:
        """The INT4 matrices repacked for torch's tinygemm kernel (those whose shape it takes), made on first use,
        for batched one-token steps of policy.tinygemm_min_rows to tinygemm_max_rows sequences in bfloat16.
        Like the 16-bit copies, never for a single sequence's steps (see `dense_copies`)."""
        if not self._takes_tinygemm(batch, tokens):
            return {}
        if not self._tinygemm:
            fitting = [m for m in self._int4_matrices if CudaTinygemmWeight.supports(m)]
            packs = {id(m): CudaTinygemmWeight.from_int4(m) for m in fitting}
            self.tinygemm_bytes = sum(p.nbytes for p in packs.values())
            info(f"small batched steps: INT4 matrices repacked for tinygemm ({self.tinygemm_bytes / 2**20:.0f} MiB)")
            self._tinygemm = packs
        return self._tinygemm

    def _takes_tinygemm(self, batch: int, tokens: int) -> bool:
        policy = self.kernels.policy
        small_batch = tokens == 1 and max(2, policy.tinygemm_min_rows) <= batch <= policy.tinygemm_max_rows
        taken = policy.tinygemm and small_batch and not policy.batch_invariant
        return taken and self.engine.dtype == torch.bfloat16 and self._tinygemm_fits

    def dense_copies(self, batch: int, tokens: int) -> dict[int, torch.Tensor]:
        """The 16-bit copies a step of `batch` sequences x `tokens` tokens multiplies instead of the INT4
        matrices (by id), made on first use; empty where the policy or the memory budget says the INT4 kernels.
        A single sequence's few-token steps (speculative verification) never take them: they run the INT4
        kernels, or the tensor-core INT4 kernel where the policy gives it those steps (`mma_int4_few_tokens`)."""
        policy = self.kernels.policy
        taken = self._takes_tinygemm(batch, tokens) or bool(self.mma_int4_weights(batch, tokens))
        batched = batch >= policy.dense_copy_min_rows and not taken
        many = batched or policy.int4_rows_on_cublas(batch * tokens)
        if not (policy.dense_copy_min_rows and many and self._dense_copies_fit and policy.cublas_16bit):
            return {}
        if not self._dense_copies:
            copies = {id(m): dequantize_int4(m, self.engine.dtype) for m in self._int4_matrices}
            self.dense_copy_bytes = sum(c.nbytes for c in copies.values())
            info(f"many-row steps: 16-bit copies of the INT4 matrices kept ({self.dense_copy_bytes / 2**20:.0f} MiB)")
            self._dense_copies = copies
        return self._dense_copies

    def _rows_on_cublas(self, batch: int, tokens: int) -> bool:
        """Whether a step of `batch` x `tokens` rows multiplies through cuBLAS (16-bit copies, or INT4
        dequantized into scratch) rather than the INT4 kernels."""
        return self.kernels.int4_rows_on_cublas(batch * tokens) or bool(self.dense_copies(batch, tokens))

    def _scratch_cache(self, batch: int, tokens: int, loops: int) -> KVCache:
        scratch = self._scratch
        if scratch is None or scratch.batch != batch or scratch.max_seq < tokens or scratch.loops < loops:
            self._scratch = None  # release the old one before allocating
            scratch = self._scratch = self.engine.new_cache(batch, tokens, loops)
        scratch.lengths = torch.zeros(batch, dtype=torch.long)
        return scratch

    def _capture(self, step: StepInput, positions: torch.Tensor, cache: KVCache, long_cache: bool) -> _Graph:
        """A graph of `step` (its tensors on the device), whose replays read their tokens, positions and resumed
        states from the static copies made here."""
        dev = self.engine.device
        static = replace(step, tokens=step.tokens.clone(), resume=None if step.resume is None else step.resume.clone())
        static_positions = positions.to(dev).clone()

        def forward() -> ForwardOutput:  # the warm-up and the capture run the very same step
            return self._forward(static, static_positions, cache, long_cache=long_cache)

        # Warm-up on a side stream (compiles the kernels); it writes the same K/V the replay will.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_allocated(dev)
        stream = self._capture_stream()
        B, T = step.tokens.shape
        window = self._graph_window(B, T)
        with l2_residency.window_during(stream, window) as no_window:
            if no_window is not None:
                window = None
                info(f"L2 residency: the decode graph's capture stream takes no window ({no_window}); not applied")
            with _cyclic_gc_paused(), torch.cuda.graph(graph, pool=self._pool, stream=stream):
                output = forward()
        nbytes = torch.cuda.memory_allocated(dev) - before
        self.graph_bytes += nbytes
        detail(f"captured a CUDA graph: batch {B}, tokens {T}, loops {step.loops}")
        return _Graph(graph, static.tokens, static_positions, output, static.resume, nbytes, window is not None)

    def _drop_share(self) -> None:
        """Before a step whose GEMMs want all of L2: no persisting share and no persisting lines."""
        if self.engine.l2_window is None or self._share_dropped:
            return
        self._share_dropped = True
        try:
            l2_residency.drop_persisting_share()
        except l2_residency.DriverError as exc:
            info(f"L2 residency: the persisting share is kept during a prefill ({exc})")

    def _restore_share(self) -> None:
        """Before a windowed graph's replay after a prefill: the persisting share its window was granted."""
        window = self.engine.l2_window
        assert window is not None
        self._share_dropped = False
        try:
            l2_residency.set_persisting_limit(int(window.nbytes * window.hit_ratio))
        except l2_residency.DriverError as exc:
            info(f"L2 residency: the persisting share is not restored after a prefill ({exc})")

    def _graph_window(self, batch: int, tokens: int) -> l2_residency.L2Window | None:
        """The L2 window a graph of `batch` x `tokens` rows is captured with: the engine's for steps whose matmuls
        read the INT4 body themselves (decode-sized), none for those that go to cuBLAS (a prefill reads the INT4
        body once, to dequantize it, and its GEMMs read the 16-bit copies, which the window does not cover) or to
        tinygemm or the tensor-core INT4 kernel (their repacks, which the window does not cover either). On the H200
        this alone did not remove the prefill cost of L2 residency (still +3-7 % on a body that
        fits): the persisting share itself takes L2 from the GEMMs (see l2_residency.SHARE_OFF_DURING_PREFILL)."""
        repacked = self._takes_tinygemm(batch, tokens) or self._takes_mma_int4(batch, tokens)
        if self._rows_on_cublas(batch, tokens) or repacked:
            return None
        return self.engine.l2_window

    def _capture_stream(self) -> torch.cuda.Stream:
        """The stream graphs are captured from, one per decoder; it carries the engine's L2 window (if any)
        during each capture only."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.engine.device)
        return self._stream

    # ---- the fused forward -------------------------------------------------------------------
    def _forward(
        self,
        step: StepInput,
        positions: torch.Tensor,
        cache: KVCache,
        *,
        last_index: torch.Tensor | None = None,
        span: int | None = None,
        long_cache: bool = False,
    ) -> ForwardOutput:
        """The model's forward of `step` (its tensors on the device) over `_FusedOps` (under graph capture:
        recorded once, replayed as kernels). last_index ([B]): the token of each row the head reads (last_only;
        default the last); span: the cache positions a prefill-sized step attends over when some row starts after
        position 0; long_cache: a one-token step attends to the policy's long_cache_keys or more."""
        B, T = step.tokens.shape
        ops = _FusedOps(self, cache, positions, B, T, step.last_only, last_index, span, long_cache)
        return run(ops, self.engine.weights, self.cfg, step.tokens, step.loops, resume=step.resume)

    def _gate_logit(self, s: torch.Tensor) -> torch.Tensor:
        """The exit gate's logit per row in float32: for decode-sized steps one matvec launch in the PDL
        chain (instead of four torch launches that each break it), else as model/ops.py computes it."""
        policy = self.kernels.policy
        if self._gate_weight is None or (s.shape[0] > policy.matvec_max_rows and not policy.batch_invariant):
            return gate_logit(self.engine.weights, s)
        return self.kernels.fused_linear(s, self._gate_weight, bias=self._gate_bias, out_dtype=torch.float32).squeeze(
            -1
        )


class _FusedOps:
    """ForwardOps (model/ops.py) of one CUDA step: rows [B * T, d], each op one or two fused launches of the
    engine's kernels (norms fused into the products that read them, RoPE + cache write + attention in one
    launch for one-token steps, residuals added in the products' epilogues)."""

    def __init__(self, dec: FusedDecoder, cache: KVCache, positions: torch.Tensor, B: int, T: int,
                 last_only: bool, last_index: torch.Tensor | None = None, span: int | None = None,
                 long_cache: bool = False) -> None:  # fmt: skip
        self.dec, self.k, self.cache, self.positions, self.long_cache = dec, dec.kernels, cache, positions, long_cache
        self.cfg, self.eng = dec.cfg, dec.engine
        self.B, self.T, self.last_only, self.last_index = B, T, last_only, last_index
        self.substitutes = dec.step_weights(B, T)
        self.mask: torch.Tensor | None = None
        self.per_query_attention = T <= FUSED_ATTENTION_MAX_TOKENS or dec.kernels.policy.batch_invariant
        if span is not None and not self.per_query_attention:
            self.mask = position_mask(positions.view(B, T), span)

    def _w(self, w: Weight) -> ProductWeight:
        """The weight this step multiplies: its tinygemm repack or 16-bit copy where the step takes one, else w."""
        return self.substitutes.get(id(w), w) if self.substitutes else w

    def embed(self, tokens: torch.Tensor, scale: float) -> torch.Tensor:
        x = embedding(tokens, self.eng.weights.embed, self.eng.dtype)
        x = x * scale if scale != 1.0 else x
        return x.reshape(self.B * self.T, self.cfg.d_model)

    def attention(
        self, x: torch.Tensor, lw: LayerWeights, slot: int, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg, eng, k = self.cfg, self.eng, self.k
        qkv = k.fused_linear(x, self._w(lw.qkv), norm_weight=lw.attn_norm.weight, eps=cfg.norm_eps,
                             bias=self.dec._qkv_bias[id(lw)])  # fmt: skip
        k_cache, v_cache = self.cache.k[slot], self.cache.v[slot]
        interleaved = cfg.rope_pairing == "interleaved"
        if self.T == 1 and ROPE_ATTENTION_ONE_KERNEL and not k.policy.batch_invariant:
            out_weight = self._w(lw.out)
            attn = OneTokenAttention(k_cache, v_cache, self.positions, eng.cos, eng.sin, cfg.n_heads, cfg.n_kv_heads,
                                     cfg.head_dim, interleaved)  # fmt: skip
            if k.attention_out_applies(self.B, attn, out_weight, self.long_cache):
                return k.attention_out(qkv, attn, out_weight, residual)
            heads = k.rope_attention(qkv, attn, long_cache=self.long_cache)
        else:
            heads = self._prompt_attention(qkv, k_cache, v_cache, interleaved)
        return self.project(heads, lw.out, residual)

    def _prompt_attention(
        self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, interleaved: bool
    ) -> torch.Tensor:
        """Attention of a step of several tokens per row: RoPE + cache write, then attention over the cache."""
        cfg, eng, k, T = self.cfg, self.eng, self.k, self.T
        q = k.rope_store(qkv, k_cache, v_cache, self.positions, eng.cos, eng.sin, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, T, interleaved)  # fmt: skip
        if self.per_query_attention:
            return k.cached_attention(q, k_cache, v_cache, self.positions, T)
        qh = q.view(self.B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        policy = k.policy
        gqa = cfg.n_heads != cfg.n_kv_heads
        if self.mask is None:
            out = sdpa(qh, k_cache[:, :, :T], v_cache[:, :, :T], causal=True, gqa=gqa,
                       math_only=policy.sdpa_math_only, cudnn=policy.sdpa_cudnn)  # fmt: skip
        else:
            span = self.mask.shape[-1]
            out = sdpa(qh, k_cache[:, :, :span], v_cache[:, :, :span], mask=self.mask, gqa=gqa,
                       math_only=policy.sdpa_math_only, cudnn=policy.sdpa_cudnn)  # fmt: skip
        return out.transpose(1, 2).reshape(self.B * T, cfg.q_dim)

    def project(
        self, h: torch.Tensor, w: Weight, residual: torch.Tensor | None = None, *, into_residual: bool = False
    ) -> torch.Tensor:
        product_weight = self._w(w)
        if residual is None:
            return self.k.fused_linear(h, product_weight)
        if into_residual:
            return self.k.fused_linear(h, product_weight, residual=residual, into_residual=True)
        return self.k.fused_linear(h, product_weight, residual=residual)

    def post_norm(self, y: torch.Tensor, n: Norm, residual: torch.Tensor, *, sum_first: bool) -> torch.Tensor:
        # rms_norm mode 1: residual + norm(y); mode 2: norm(y + residual)
        return self.k.rms_norm(y, n.weight, self.cfg.norm_eps, residual, 2 if sum_first else 1)

    def mlp(self, x: torch.Tensor, lw: LayerWeights, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.k.persistent_mlp_applies(x, lw.gate_up, lw.down):
            return self.k.persistent_mlp(x, lw.mlp_norm.weight, self.cfg.norm_eps, lw.gate_up, lw.down, residual)
        return self.project(self.mlp_in(x, lw), lw.down, residual, into_residual=residual is not None)

    def mlp_in(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        act = self.k.ACT_SWIGLU if lw.gate_up is not None else self.k.ACT_GELU
        up = lw.gate_up if lw.gate_up is not None else lw.up
        assert up is not None
        return self.k.fused_linear(x, self._w(up), norm_weight=lw.mlp_norm.weight, eps=self.cfg.norm_eps, act=act)

    def norm(self, x: torch.Tensor, n: Norm) -> torch.Tensor:
        return self.k.rms_norm(x, n.weight, self.cfg.norm_eps)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.k.add(a, b)

    def concat_project(self, state: torch.Tensor, prelude_out: torch.Tensor, adapter: Weight) -> torch.Tensor:
        return self.k.fused_linear(torch.cat((state, prelude_out), dim=-1), self._w(adapter))

    def zeros_state(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like)

    def noise_state(self, like: torch.Tensor) -> torch.Tensor:
        assert self.eng.noise is not None, "random state start needs the noise table"
        return self.eng.noise[self.positions].to(like.dtype)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gate(self, state: torch.Tensor) -> torch.Tensor:
        return self.dec._gate_logit(state).view(self.B, self.T)

    def head(self, x: torch.Tensor, n: Norm | None, scale: float) -> torch.Tensor:
        if not self.last_only:
            rows = x
        elif self.last_index is None:
            rows = x.view(self.B, self.T, -1)[:, -1]
        else:
            rows = x.view(self.B, self.T, -1)[torch.arange(self.B, device=x.device), self.last_index]
        logits = self.k.fused_linear(rows, self._w(self.eng.weights.head), norm_weight=None if n is None else n.weight,
                                     eps=self.cfg.norm_eps, out_dtype=torch.float32)  # fmt: skip
        if scale != 1.0:
            logits = logits * scale
        return logits.view(self.B, 1 if self.last_only else self.T, -1)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(self.B, self.T, -1)

    def where_rows(self, take_new: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        keep_new = take_new.repeat_interleave(self.T).view(-1, 1)
        return torch.where(keep_new, new, old)

    def resume(self, state: torch.Tensor, prelude_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.d_model
        return state.reshape(self.B * self.T, d), prelude_out.reshape(self.B * self.T, d)
