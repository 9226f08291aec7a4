"""Runs forward steps of a loaded model over a KV cache: positions, masks, and cache bookkeeping."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from tinyloop.cache.base import StepCache
from tinyloop.cache.kv import KVCache
from tinyloop.cache.memory import check_host_memory
from tinyloop.config import ArchConfig
from tinyloop.errors import ModelClosedError
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.log import detail
from tinyloop.model.layers import KVStore, StepContext, position_mask, rope_tables
from tinyloop.model.looped import ForwardOutput, Resume, forward, state_noise_table
from tinyloop.model.weights import ModelWeights
from tinyloop.runtime.decode_path import Decoder, StepInput

if TYPE_CHECKING:
    from tinyloop.kernels.l2_residency import L2Window

# Steps of at most this many rows run on one CPU thread: single-row products are bound by memory reads, a
# second thread does not speed them up, and on a busy machine the thread pool waits on every op (a 17-token
# prompt's prefill: 0.2 s on one thread, 1-6 s on two when the other core is busy).
SINGLE_THREAD_ROWS = 256


@contextmanager
def cpu_threads_for(device: torch.device, rows: int) -> Iterator[None]:
    if device.type != "cpu" or rows > SINGLE_THREAD_ROWS or torch.get_num_threads() == 1:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Engine:
    """A model's weights on one device, plus the tables every step shares (RoPE, start-state noise)."""

    def __init__(
        self,
        cfg: ArchConfig,
        weights: ModelWeights,
        device: torch.device,
        dtype: torch.dtype,
        l2_window: L2Window | None = None,
        max_positions: int | None = None,
        kernel_policy: KernelPolicy | None = None,
        lookahead: bool | None = None,
    ) -> None:
        self.cfg = cfg
        self.weights = weights
        self.device = device
        self.dtype = dtype
        # Where the looped weights sit in one arena that L2 keeps (kernels/l2_residency.py): decode graphs
        # are captured from a stream carrying this window.
        self.l2_window = l2_window
        # The CUDA kernel choices (kernels/policy.py), built once at load; the decoder passes it to every launch.
        self.kernel_policy = kernel_policy if kernel_policy is not None else KernelPolicy()
        # Whether the decode loop runs the host one step ahead where the rows allow it (runtime/decode.py): on
        # a GPU, whose steps would otherwise wait for the host's bookkeeping of every token.
        self.lookahead = device.type == "cuda" if lookahead is None else lookahead
        # Steps run one at a time: the decoders keep per-batch-size workspaces between steps.
        self.lock = threading.RLock()
        self.closed = False
        self.decoder: Decoder | None = None
        self.reserve_positions(cfg.max_position if max_positions is None else max_positions)

    def reserve_positions(self, positions: int) -> None:
        """Size the position tables (RoPE, start-state noise) for `positions` (at most the model's
        max_position); they are built for what a run asks for, never for the header's maximum."""
        if not 1 <= positions <= self.cfg.max_position:
            limit = self.cfg.max_position
            raise ValueError(f"positions must be in [1, {limit}] (the model's max_position), got {positions}")
        # Built on the host: float64 angles, then float32 tables (and the noise rows of a random start).
        noise_row = self.cfg.d_model * 8 if self.cfg.state_start == "random" else 0
        check_host_memory(torch.device("cpu"), positions * (self.cfg.head_dim // 2 * 24 + noise_row))
        with self.lock:
            self.max_positions = positions
            self.cos, self.sin = rope_tables(self.cfg, positions, self.device)
            self.noise = state_noise_table(self.cfg, positions, self.device)
            noise = "" if self.noise is None else f"; start-state noise {self.noise.nbytes / 2**20:.2f} MiB"
            detail(
                f"allocated RoPE tables: {positions} positions, {(self.cos.nbytes + self.sin.nbytes) / 2**20:.2f} MiB "
                f"on {self.device}{noise}"
            )
            if self.decoder is not None:  # it holds the old tables; its weight copies go before the new one's
                self.decoder.release()
                self.decoder = None
            self.decoder = select_decoder(self)

    def close(self) -> None:
        """Releases the decoder's graphs and scratch now and drops the decoder, whose reference back to this
        engine would otherwise keep the weights alive until Python's cyclic collector runs."""
        self.closed = True
        decoder, self.decoder = self.decoder, None
        if decoder is not None:
            decoder.release()

    def new_cache(self, batch: int, max_seq: int, loops: int) -> KVCache:
        return KVCache(self.cfg, batch, max_seq, loops, self.device, self.dtype)

    def context(self, positions: torch.Tensor, cache: KVStore | None, attend_len: int | None) -> StepContext:
        """attend_len None: attend causally over this step's own tokens (no earlier context)."""
        mask = None if attend_len is None else position_mask(positions, attend_len)
        return StepContext(positions, self.cos[positions], self.sin[positions], mask, cache)

    def step(
        self,
        tokens: torch.Tensor,
        cache: StepCache | None,
        loops: int,
        *,
        valid: torch.Tensor | None = None,
        last_only: bool = False,
        collect_states: bool = False,
        start: torch.Tensor | None = None,
        resume: Resume | None = None,
        depth: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run tokens [B, T] (right-padded; `valid[b]` real tokens in row b) through the model.

        By default the tokens are appended after what the cache holds (without a cache they are the
        whole sequence from position 0). `start` ([B]) places them at other positions instead, e.g. to
        recompute positions already in the cache deeper: from `resume` only the iterations after
        resume.start_loop, the coda and the head run (warm start, verification).
        depth ([B]): per-row iterations, at most `loops` (rows past theirs keep their state; see `forward`).
        Thread-safe (steps are serialised); raises ModelClosedError once the engine is closed.
        """
        with self.lock, torch.inference_mode():
            if self.closed:
                raise ModelClosedError()
            if depth is not None and bool((depth == loops).all()):
                depth = None
            if start is None:
                start = torch.zeros(tokens.shape[0], dtype=torch.long) if cache is None else cache.lengths
            step = StepInput(tokens, loops, start.to("cpu", torch.long), valid, last_only, resume)
            return self._step(step, cache, collect_states, depth)

    def _step(
        self, step: StepInput, cache: StepCache | None, collect_states: bool, depth: torch.Tensor | None
    ) -> ForwardOutput:
        tokens, loops, start = step.tokens, step.loops, step.start
        B, T = tokens.shape
        valid_cpu = torch.full((B,), T, dtype=torch.long) if step.valid is None else step.valid.to("cpu", torch.long)
        end = int((start + T).max())
        if cache is not None:
            if loops > cache.loops:
                raise ValueError(f"this cache holds {cache.loops} loops; {loops} were asked")
            if end > cache.max_seq:
                raise ValueError(f"sequence of {end} tokens exceeds the cache's max_seq_len {cache.max_seq}")
        if end > self.max_positions:
            limit = "maximum position" if self.max_positions == self.cfg.max_position else "max_seq_len"
            raise ValueError(f"position {end} exceeds the model's {limit} {self.max_positions}")
        dense = cache is None or (isinstance(cache, KVCache) and cache.k.dtype == self.dtype)
        if self.decoder is not None and dense and not collect_states and depth is None:
            kv = cache if isinstance(cache, KVCache) else None
            handled = self.decoder.decode(step, kv)
            if handled is not None:
                if cache is not None:
                    cache.lengths = torch.maximum(cache.lengths, start + valid_cpu)
                return handled
        if self.kernel_policy.batch_invariant:
            reasons = {
                "per-iteration states": collect_states,
                "per-row exit depths": depth is not None,
                f"a {type(cache).__name__} cache": not dense,
                "cross-iteration weights": self.decoder is None,
            }
            why = ", ".join(r for r, applies in reasons.items() if applies) or "a step the fused decoder declines"
            raise ValueError(f"TINYLOOP_BATCH_INVARIANT=1 covers the fused CUDA steps only; this one needs the "
                             f"generic path ({why})")  # fmt: skip
        positions = (start[:, None] + torch.arange(T)[None, :]).to(self.device)
        fresh = cache is None or int(start.max()) == 0
        ctx = self.context(positions, cache, None if fresh else end)
        begin_step = getattr(cache, "begin_step", None)
        if begin_step is not None:  # the store lays out its own span (sliding-window ring)
            ctx.mask = begin_step(positions, start, valid_cpu)
        last_index = (valid_cpu - 1).to(self.device) if step.last_only else None
        with cpu_threads_for(self.device, B * T):
            out = forward(
                self.weights, self.cfg, tokens.to(self.device), ctx, loops,
                dtype=self.dtype, noise=self.noise, last_index=last_index, collect_states=collect_states,
                resume=step.resume, depth=None if depth is None else depth.to(self.device),
            )  # fmt: skip
        if cache is not None:
            cache.lengths = torch.maximum(cache.lengths, start + valid_cpu)
        return out


def select_decoder(engine: Engine) -> Decoder | None:
    """The specialised decode step for this engine's device (CPU fast path, CUDA graphs), or None for the
    generic forward everywhere."""
    if engine.device.type == "cpu":
        from tinyloop.runtime import cpu_decode

        if not cpu_decode.supports(engine.cfg, engine.weights, engine.device, engine.dtype):
            return None
        return cpu_decode.CpuDecoder(engine.cfg, engine.weights, engine.cos, engine.sin, engine.noise)
    from tinyloop.model.cross_iter import has_cross_iter

    if has_cross_iter(engine.weights):  # each iteration draws its own weights: only the generic path does
        return None
    if engine.device.type == "cuda":
        from tinyloop.kernels.cuda_backend import triton_available

        if not triton_available():
            return None
        from tinyloop.runtime.fused_decode import FusedDecoder

        return FusedDecoder(engine)
    return None
