"""Model methods that reuse work across calls: prefix caches, prefix pools, warm start to a deeper L,
and the KV mode's metadata."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from tinyloop.api.base import ModelBase
from tinyloop.api.handles import CacheHandle, PrefixCache, ResumeHandle
from tinyloop.api.tokens import as_token_array
from tinyloop.cache.base import ModeCache, copy_out
from tinyloop.cache.factory import kv_bytes_per_token, make_cache
from tinyloop.cache.pool import PrefixPool
from tinyloop.model.looped import Resume
from tinyloop.runtime.continuation import continue_tokens
from tinyloop.runtime.stats import GenerationStats
from tinyloop.sampling import SamplingParams

H = TypeVar("H", bound=CacheHandle)

# first(cache) makes the request's cache hold the whole sequence and returns the next-token logits [V].
FirstLogits = Callable[[ModeCache | None], torch.Tensor]


class CachingMixin(ModelBase):
    """Prefix caches, prefix pools, warm starts and the KV mode's metadata."""

    @property
    def kv_mode(self) -> str:
        """'16bit', 'int8', 'window', 'hidden' or 'none'."""
        return self.kv.mode

    @property
    def cache_window(self) -> int:
        """Positions a sliding-window cache keeps per slot (0: a full cache)."""
        return self.kv.window

    def kv_bytes_per_token(self, loops: int | None = None) -> int:
        """Cache bytes one token of context costs at `loops` in this model's KV mode (0 in mode 'none';
        a sliding window holds at most cache_window such tokens)."""
        self._check_open()
        return kv_bytes_per_token(self.kv, self.header.config, self._loops(loops), self._engine.dtype)

    # ---- helpers ----------------------------------------------------------------------------------
    def _own(self, handle: H) -> H:
        self._handles.add(handle)
        return handle

    def _checked(self, handle: Any, cls: type[H]) -> H:
        if not isinstance(handle, cls):
            raise TypeError(f"expected a {cls.__name__}, got {type(handle).__name__}")
        handle._check()
        if handle.model_key != self.cache_identity:
            raise ValueError(
                f"this {handle.kind} belongs to model {handle.model_key}, but this model is {self.cache_identity} "
                "(other weights, dtype or KV mode); rebuild it with this model"
            )
        return handle

    def _continue(self, sequence: torch.Tensor, first: FirstLogits, params: SamplingParams, what: str) -> Iterator[int]:
        """Decode after a start state that `first` sets up in the request's own cache (taken on first next())."""
        self._check_room(int(sequence.numel()), params.max_tokens)
        self.last_stats = stats = GenerationStats()
        engine = self._engine
        loops = params.loops
        assert loops is not None

        def tokens() -> Iterator[int]:
            with self._request_cache(loops, what=what) as cache:
                yield from continue_tokens(engine, cache, sequence, lambda: first(cache), params.max_tokens,
                                           loops, params, stats)  # fmt: skip

        return tokens()

    def _run_prompt(self, ids: torch.Tensor, cache: ModeCache | None, loops: int) -> Any:
        if cache is not None:
            cache.truncate(0)
        out = self._engine.step(ids[None], cache, loops, last_only=True)
        assert out.logits is not None
        return out

    # ---- prefix caches ----------------------------------------------------------------------------
    def build_prefix_cache(self, prefix: Any, loops: int | None = None) -> PrefixCache:
        """Run `prefix` once at `loops` and snapshot the K/V of every slot (plus its last logits)."""
        self._check_open()
        ids = self._tokens(prefix, "prefix")
        n_loops = self._loops(loops)
        with self._request_cache(n_loops, what="build_prefix_cache") as cache:
            assert cache is not None
            out = self._run_prompt(ids, cache, n_loops)
            kv = cache.snapshot(int(ids.numel()), n_loops)
            logits = copy_out(out.logits[0, -1], "prefix logits")
        return self._own(PrefixCache(self.cache_identity, ids.numpy(), n_loops, kv, logits))

    def _prefix_tensor_spec(self, length: int, loops: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of what export_tensors() gives for a prefix of `length` tokens at `loops`
        in this model's KV mode (a saved pool's entry is checked against it). Built on the meta device."""
        spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "tokens": ((length,), torch.int32),
            "last_logits": ((self.header.config.vocab_size,), torch.float32),
        }
        meta = torch.device("meta")
        ref = make_cache(self.kv, self.header.config, 1, length, loops, meta, self._engine.dtype)
        if ref is not None:
            ref.lengths = torch.tensor([length])
            for name, t in ref.snapshot(length, loops).items():
                spec[f"kv.{name}"] = (tuple(t.shape), t.dtype)
        return spec

    def _prefix_cache_from_tensors(self, tensors: dict[str, torch.Tensor], loops: int) -> PrefixCache:
        """Rebuild a PrefixCache from PrefixCache.export_tensors() (a loaded pool file)."""
        tokens = as_token_array(tensors["tokens"], self.header.config.vocab_size, "saved prefix")
        kv = {name.removeprefix("kv."): t for name, t in tensors.items() if name.startswith("kv.")}
        return self._own(PrefixCache(self.cache_identity, tokens, loops, kv, tensors["last_logits"]))

    def stream_from_prefix_cache(
        self,
        cache: PrefixCache,
        suffix: Any = None,
        max_tokens: int = 128,
        loops: int | None = None,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Iterator[int]:
        """generate_from_prefix_cache, one token id at a time."""
        self._check_open()
        cache = self._checked(cache, PrefixCache)
        n_loops = cache.loops if loops is None else self._loops(loops)
        if n_loops != cache.loops:
            raise RuntimeError(
                f"loops mismatch: the prefix cache was built at loops={cache.loops}, but loops={n_loops} was "
                f"asked; pass loops={cache.loops} or rebuild the prefix at loops={n_loops}"
            )
        raw = [] if suffix is None else suffix
        suffix_ids = torch.from_numpy(
            as_token_array(raw, self.header.config.vocab_size, "suffix", allow_empty=True).astype(np.int64)
        )
        params = self._params(max_tokens=max_tokens, loops=n_loops, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed)  # fmt: skip
        if self.kv.mode == "none":
            raise ValueError(
                "generate_from_prefix_cache needs a KV cache, but this model runs with kv_mode 'none' "
                "(TINYLOOP_DISABLE_KV_CACHE=1); create the Model with another kv_mode"
            )
        n = int(cache.tokens.size)
        kv, logits = cache.kv(), cache.last_logits()
        assert kv is not None
        engine = self._engine

        def first(working: ModeCache | None) -> torch.Tensor:
            assert working is not None
            working.restore(kv, n, n_loops, n)
            if suffix_ids.numel() == 0:
                return logits
            out = engine.step(suffix_ids[None], working, n_loops, last_only=True)
            assert out.logits is not None
            return out.logits[0, -1]

        sequence = torch.cat((torch.from_numpy(cache.tokens.astype(np.int64)), suffix_ids))
        return self._continue(sequence, first, params, "generate_from_prefix_cache")

    def generate_from_prefix_cache(
        self,
        cache: PrefixCache,
        suffix: Any = None,
        max_tokens: int = 128,
        loops: int | None = None,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> np.ndarray:
        """New token ids after prefix + suffix, without recomputing the prefix. loops defaults to the
        cache's; another value raises RuntimeError('loops mismatch: ...')."""
        stream = self.stream_from_prefix_cache(cache, suffix, max_tokens, loops, temperature, top_k, top_p, seed)
        return np.fromiter(stream, dtype=np.int32)

    # ---- prefix pools -------------------------------------------------------------------------------
    def register_prefix(self, pool: PrefixPool, cache: PrefixCache) -> str:
        """pool.register(cache) after checking the cache belongs to this model; returns its content key."""
        self._check_open()
        key = pool.register(self._checked(cache, PrefixCache))
        self._pools.add(pool)
        return key

    def stream_with_pool(
        self,
        pool: PrefixPool,
        tokens: Any,
        max_tokens: int = 128,
        loops: int | None = None,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Iterator[int]:
        """generate_with_pool, one token id at a time."""
        self._check_open()
        ids = self._tokens(tokens, "tokens")
        params = self._params(max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed)  # fmt: skip
        n_loops = params.loops
        assert n_loops is not None
        what = "generate_with_pool"
        if self.kv.mode == "none":
            raise ValueError(
                f"{what} needs a KV cache, but this model runs with kv_mode 'none' "
                "(TINYLOOP_DISABLE_KV_CACHE=1); create the Model with another kv_mode"
            )
        self._check_room(int(ids.numel()), params.max_tokens)
        self._pools.add(pool)
        engine = self._engine
        match = pool.lookup(ids.numpy(), n_loops, self.cache_identity, self._can_use)
        if match is None:

            def first(working: ModeCache | None) -> torch.Tensor:
                return self._run_prompt(ids, working, n_loops).logits[0, -1]

            return self._continue(ids, first, params, what)
        item = self._checked(match.item, PrefixCache)
        kv, logits, length, reuse = item.kv(), item.last_logits(), int(item.tokens.size), match.reuse
        assert kv is not None

        def first_from_match(working: ModeCache | None) -> torch.Tensor:
            assert working is not None
            working.restore(kv, length, n_loops, reuse)
            if match.exact:
                return logits
            out = engine.step(ids[None, reuse:], working, n_loops, last_only=True)
            assert out.logits is not None
            return out.logits[0, -1]

        return self._continue(ids, first_from_match, params, what)

    def _can_use(self, length: int, use: int) -> bool:
        """Whether a snapshot of `length` tokens serves its first `use` exactly in this KV mode."""
        window = min(self.kv.window, self.max_seq_len)
        return 0 <= use <= length and (self.kv.mode != "window" or use == length or length <= window)

    def generate_with_pool(
        self,
        pool: PrefixPool,
        tokens: Any,
        max_tokens: int = 128,
        loops: int | None = None,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> np.ndarray:
        """Generate after `tokens`, starting from the registered prefix cache that shares the longest
        prefix with them (entries longer than the prompt are truncated); a miss runs the whole prompt."""
        stream = self.stream_with_pool(pool, tokens, max_tokens, loops, temperature, top_k, top_p, seed)
        return np.fromiter(stream, dtype=np.int32)

    # ---- warm start ---------------------------------------------------------------------------------
    def build_resume_handle(self, prompt: Any, loops: int | None = None) -> ResumeHandle:
        """Run `prompt` at `loops`, keeping its K/V, last logits, final loop state and prelude output."""
        self._check_open()
        ids = self._tokens(prompt, "prompt")
        n_loops = self._loops(loops)
        with self._request_cache(n_loops) as cache:
            out = self._run_prompt(ids, cache, n_loops)
            assert out.loop_state is not None and out.prelude_out is not None
            kv = None if cache is None else cache.snapshot(int(ids.numel()), n_loops)
        return self._own(
            ResumeHandle(
                self.cache_identity, ids.numpy(), n_loops, kv, copy_out(out.logits[0, -1], "resume logits"),
                copy_out(out.loop_state, "resume state"), copy_out(out.prelude_out, "resume state"),
            )
        )  # fmt: skip

    def stream_resume(
        self,
        handle: ResumeHandle,
        loops: int | None = None,
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Iterator[int]:
        """resume_generate, one token id at a time."""
        self._check_open()
        handle = self._checked(handle, ResumeHandle)
        n_loops = handle.loops if loops is None else self._loops(loops)
        if n_loops < handle.loops:
            raise ValueError(
                f"resume_generate can only go deeper: the handle ran {handle.loops} loops and loops={n_loops} "
                f"was asked; build a handle at loops={n_loops} (build_resume_handle) or call generate()"
            )
        params = self._params(max_tokens=max_tokens, loops=n_loops, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed)  # fmt: skip
        ids = torch.from_numpy(handle.tokens.astype(np.int64))
        n = int(ids.numel())
        kv, logits = handle.kv(), handle.last_logits()
        engine, start_loop = self._engine, handle.loops
        resume = Resume(*handle.state(), start_loop)

        def first(working: ModeCache | None) -> torch.Tensor:
            if working is not None:
                assert kv is not None
                working.restore(kv, n, start_loop, n)
            if n_loops == start_loop:
                return logits
            out = engine.step(
                ids[None], working, n_loops, start=torch.zeros(1, dtype=torch.long), resume=resume, last_only=True
            )
            assert out.logits is not None
            return out.logits[0, -1]

        return self._continue(ids, first, params, "")

    def resume_generate(
        self,
        handle: ResumeHandle,
        loops: int | None = None,
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> np.ndarray:
        """Continue the handle's prompt at `loops` >= its own: only the missing iterations (and the coda)
        run over the stored state; the same loops continues directly; fewer raises ValueError."""
        stream = self.stream_resume(handle, loops, max_tokens, temperature, top_k, top_p, seed)
        return np.fromiter(stream, dtype=np.int32)
