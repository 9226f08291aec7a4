"""`tinyloop.Scheduler`: continuous batching for one Model — requests submitted from any thread join a
fixed set of cache rows while others decode (the loop itself: runtime/scheduler.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tinyloop.api.decoding import depth_schedule, grammar_index, model_vocab
from tinyloop.api.handles import PrefixCache
from tinyloop.api.model import Model
from tinyloop.cache.factory import make_cache
from tinyloop.cache.pool import PrefixPool
from tinyloop.grammar.vocab import TokenVocab
from tinyloop.runtime.adaptive_exit import ExitCriterion
from tinyloop.runtime.decode import Row
from tinyloop.runtime.prefix_hooks import PrefixHooks
from tinyloop.runtime.requests import Request, RequestHandle, RequestStats
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.scheduler import SchedulerLimits, SlotScheduler
from tinyloop.runtime.stop_strings import StopStringFilter
from tinyloop.runtime.warm_up import WarmUpReport, decode_buckets, warm_up
from tinyloop.sampling import SamplingParams

# The prefix pool a Scheduler keeps by default (prefix_pool=True): at most this many bytes of prompt K/V.
DEFAULT_POOL_BYTES = 64 << 20
DEFAULT_QUEUE = 1024
# Prompt tokens per step: on a CPU a step of 256 already stalls the running streams for a while; a GPU's
# prefill step costs mostly host time whatever its length (H200, seed-407m, Poisson arrivals in
# docs/BENCHMARKS.md: 1,024 gave 1.08x a static batch's throughput where 256 gave 0.84x).
DEFAULT_PREFILL_CHUNK = {"cpu": 256, "cuda": 1024}
DEFAULT_PREFILL_ROWS = 4
# The prompts warm_up prefills besides the one-token prompts of its decode waves: 16 tokens (the longest step
# a GPU's cached-attention kernel takes) and a longer one (SDPA's), each cut to fit max_seq_len.
WARM_UP_PROMPT_LENGTHS = (16, 256)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class Scheduler(SlotScheduler):
    """Continuous batching over `max_batch` slots (rows of one static per-(iteration, layer) cache).

    `submit(prompt, **generate's keyword arguments)` returns a RequestHandle at once (thread-safe; a full
    queue raises QueueFullError); the engine thread admits waiting requests into free slots, prefilling at
    most `prefill_chunk_tokens` prompt tokens (default 1,024 on a GPU, 256 elsewhere) per step between batched
    decode steps, so running requests keep streaming: in rounds of up to `prefill_rows` admitted prompts (at
    most max_batch), through a staging cache of that many rows of max_seq_len tokens (its memory comes on top
    of the slots'). On a GPU a round is one batched forward; on a CPU one forward per prompt. Each request's
    tokens are those `Model.generate` gives with the same arguments (greedy exactly; seeded sampling exactly
    on the CPU).

    max_seq_len: prompt + max_tokens of one request (default: the model's max_seq_len). max_loops: the
    deepest request allowed (default: the model's default loops); the slots hold that many iterations.
    prefix_pool: True (default) keeps a private tinyloop.PrefixPool of DEFAULT_POOL_BYTES; False turns
    it off; a PrefixPool is used as given (it must then not be used by other threads while this runs).
    Admission starts from the pool's longest matching prefix; each prefilled prompt is offered to it.

    Run with start()/stop() or `with tinyloop.Scheduler(model) as s:` (stop drains on a normal exit).
    `warm_up()` before the first request pays a GPU's first-use compiles and graph captures up front.
    """

    def __init__(
        self,
        model: Model,
        max_batch: int = 8,
        max_seq_len: int | None = None,
        max_queue: int = DEFAULT_QUEUE,
        *,
        max_loops: int | None = None,
        prefill_chunk_tokens: int | None = None,
        prefill_rows: int = DEFAULT_PREFILL_ROWS,
        prefix_pool: PrefixPool | bool = True,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"Scheduler takes a tinyloop.Model, got {type(model).__name__}")
        model._check_open()
        seq = model.max_seq_len if max_seq_len is None else _positive("max_seq_len", max_seq_len)
        if seq > model.max_seq_len:
            raise ValueError(f"max_seq_len {seq} exceeds the model's max_seq_len {model.max_seq_len}; "
                             "load the Model with a larger max_seq_len")  # fmt: skip
        limits = SchedulerLimits(
            max_batch=_positive("max_batch", max_batch),
            max_seq_len=seq,
            max_loops=model._loops(max_loops),
            max_queue=_positive("max_queue", max_queue),
            prefill_chunk_tokens=_positive(
                "prefill_chunk_tokens",
                DEFAULT_PREFILL_CHUNK.get(model.device.type, 256)
                if prefill_chunk_tokens is None
                else prefill_chunk_tokens,
            ),
            prefill_rows=min(_positive("prefill_rows", prefill_rows), max_batch),
        )
        self.model = model
        engine = model._engine
        cfg = model.header.config

        def new_cache(batch: int) -> Any:
            return make_cache(model.kv, cfg, batch, seq, limits.max_loops, engine.device, engine.dtype)

        pool: PrefixPool | None
        if prefix_pool is True:
            pool = PrefixPool(DEFAULT_POOL_BYTES)
        elif prefix_pool is False:
            pool = None
        elif isinstance(prefix_pool, PrefixPool):
            pool = prefix_pool
        else:
            raise TypeError(f"prefix_pool must be True, False or a tinyloop.PrefixPool, got {prefix_pool!r}")
        hooks = None
        if pool is not None and model.kv.mode != "none":
            model._pools.add(pool)
            key = model.cache_identity

            def make_entry(ids: np.ndarray, loops: int, kv: dict[str, torch.Tensor], logits: torch.Tensor) -> Any:
                return model._own(PrefixCache(key, ids, loops, kv, logits))

            hooks = PrefixHooks(pool, key, model._can_use, make_entry)
        self.prefix_pool = pool
        self._vocab: TokenVocab | None = None
        super().__init__(engine, new_cache, limits, hooks)

    def submit(
        self,
        prompt: Any,
        max_tokens: int = 128,
        loops: int | None = None,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        stop_tokens: Any = None,
        stop: Any = None,
        grammar: Any = None,
        l_warmup_tokens: int = 0,
        l_warmup_loops: int = 2,
        exit_criterion: str | None = None,
        exit_tol: float | None = None,
        min_loops: int = 1,
        logprobs: int | None = None,
    ) -> RequestHandle:
        """Queue a request (prompt: token ids; arguments as in `Model.generate`, checked here: ValueError /
        TypeError). Raises QueueFullError when max_queue requests are already waiting.

        exit_criterion / exit_tol / min_loops (as in `generate_tokens`): each decode token of this request
        stops iterating when its criterion fires, inside the batched step; `handle.stats.token_loops`."""
        model = self.model
        model._check_open()
        ids = model._tokens(prompt, "prompt")
        params = model._params(
            max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop_tokens=stop_tokens, stop=stop, grammar=grammar, l_warmup_tokens=l_warmup_tokens,
            l_warmup_loops=l_warmup_loops, logprobs=logprobs, exit_criterion=exit_criterion, exit_tol=exit_tol,
            min_loops=min_loops,
        )  # fmt: skip
        return self._enqueue(self._request(ids, params))

    def _request(self, ids: torch.Tensor, params: SamplingParams) -> Request:
        """The scheduled request for a checked prompt and its params; ValueError where this scheduler's limits
        refuse it."""
        model = self.model
        n_loops = params.loops
        assert n_loops is not None
        limits = self.limits
        if n_loops > limits.max_loops:
            raise ValueError(f"loops {n_loops} exceeds this scheduler's max_loops {limits.max_loops}; "
                             f"create the Scheduler with max_loops >= {n_loops}")  # fmt: skip
        if ids.numel() + params.max_tokens > limits.max_seq_len:
            raise ValueError(f"prompt ({ids.numel()} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"scheduler's max_seq_len {limits.max_seq_len}")  # fmt: skip
        vocab = self._model_vocab() if params.grammar is not None or params.stop else None
        index = grammar_index(params.grammar, vocab, model.device) if vocab is not None else None
        schedule = depth_schedule(params.l_warmup_tokens, params.l_warmup_loops, n_loops)
        row = Row(ids, n_loops, params.max_tokens, TokenPicker(params, index, params.stop_tokens), schedule,
                  exit=self._exit_criterion(params))  # fmt: skip
        stop_filter = StopStringFilter(vocab, params.stop) if params.stop and vocab is not None else None
        handle = RequestHandle(int(ids.numel()))
        handle.stats.logprobs = row.stats.logprobs  # the decode loop's records, read as the tokens arrive
        return Request(row, handle, stop_filter)

    def warm_up(self, loops: int | Sequence[int] | None = None) -> WarmUpReport:
        """Run a fixed set of internal requests through this scheduler before any traffic, so that what a GPU
        does on first use (compile Triton kernels, capture a CUDA graph per decode batch size) happens here
        rather than inside the first requests (a cold H100 put ~10 s of it there).

        One wave per decode batch size (the powers of two below max_batch, then max_batch), largest first:
        that many one-token greedy prompts, queued together, so that they fill the leading slots and decode
        at least one step together. Then a 16-token prompt, sampled (temperature 0.8, top_p 0.9, seed 0), and a
        greedy one of up to 256 tokens, both cut to fit max_seq_len. All of it at each depth of `loops` (one
        count or several, at most max_loops; default: the model's default loops, at most max_loops): a GPU
        captures a decode graph per batch size and depth, so a server whose clients ask several depths warms
        up each. A few tokens each: a few seconds on the CPU for the built-in model at max_batch 8, and on a
        GPU mostly the compiles and captures themselves.

        Works started (the engine thread runs the requests) or not (it steps the scheduler itself). It
        leaves no trace: every slot free, nothing read from or offered to the prefix pool, `stats()` as
        before. Returns a WarmUpReport (seconds, the batch sizes decoded, loops, requests run).

        Raises RuntimeError if requests are waiting or running (warm it up before submitting), or if a
        warm-up request fails; `submit` raises RuntimeError while the warm-up runs. ValueError: max_seq_len
        too short for a decode step, or loops not positive integers up to max_loops."""
        model = self.model
        model._check_open()
        limits = self.limits
        depths = self._warm_up_depths(loops)
        # Each request must still hold its slot when its wave's last one is admitted (one-token prompts: up
        # to prefill_chunk_tokens of them per step), so that a decode step spans the whole wave.
        max_tokens = 1 + -(-limits.max_batch // limits.prefill_chunk_tokens)
        room = limits.max_seq_len - max_tokens
        if room < 1:
            raise ValueError(f"warm_up needs max_seq_len >= {max_tokens + 1} for a decode step of every batch "
                             f"size; this scheduler's is {limits.max_seq_len}")  # fmt: skip
        vocab = model.header.config.vocab_size

        def request(length: int, first: int, depth: int, **sampling: Any) -> Request:
            ids = torch.arange(first, first + length) % vocab
            return self._request(ids, model._params(max_tokens=max_tokens, loops=depth, **sampling))

        short, long = (min(length, room) for length in WARM_UP_PROMPT_LENGTHS)
        waves: list[list[Request]] = []
        for depth in depths:
            waves += [[request(1, i, depth, temperature=0.0) for i in range(size)]
                      for size in decode_buckets(limits.max_batch)]  # fmt: skip
            waves.append([request(short, 0, depth, temperature=0.8, top_p=0.9, seed=0),
                          request(long, 1, depth, temperature=0.0)])  # fmt: skip
        return warm_up(self, waves, depths)

    def _warm_up_depths(self, loops: int | Sequence[int] | None) -> tuple[int, ...]:
        """The distinct depths a warm-up covers, in the order given."""
        max_loops = self.limits.max_loops
        if loops is None:
            return (min(self.model._loops(None), max_loops),)
        values = [loops] if isinstance(loops, (int, np.integer)) else list(loops)
        if not values:
            raise ValueError("warm_up loops must name at least one depth")
        depths = tuple(dict.fromkeys(_positive("warm_up loops", value) for value in values))
        deeper = [depth for depth in depths if depth > max_loops]
        if deeper:
            raise ValueError(f"warm_up loops {deeper} exceed this scheduler's max_loops ({max_loops}); raise "
                             "max_loops (tinyloop serve: --max-loops)")  # fmt: skip
        return depths

    def _exit_criterion(self, params: SamplingParams) -> ExitCriterion | None:
        if params.exit_criterion is None:
            return None
        if self.slots is None:
            raise ValueError("exit_criterion needs a KV cache; this model runs with kv_mode 'none'")
        if params.exit_criterion == "gate" and not self.model.header.config.exit_gate:
            raise ValueError("the 'gate' exit criterion needs a model with an exit gate (Ouro)")
        return ExitCriterion(params.exit_criterion, params.exit_tol, params.min_loops)

    def _model_vocab(self) -> TokenVocab:
        if self._vocab is None:
            self._vocab = model_vocab(self.model.header.config, self.model._tokenizer_json())
        return self._vocab


__all__ = ["RequestHandle", "RequestStats", "Scheduler", "WarmUpReport"]
