"""Model methods that reuse work across calls: prefix caches, prefix pools, warm start to a deeper L,
and the KV mode the model's working cache uses."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from tinyloop.api.handles import CacheHandle, PrefixCache, ResumeHandle
from tinyloop.api.tokens import as_token_array
from tinyloop.cache.base import ModeCache, copy_out
from tinyloop.cache.factory import KVModeChoice, kv_bytes_per_token, resolve_kv_mode
from tinyloop.cache.pool import PrefixPool
from tinyloop.env import RuntimeEnv
from tinyloop.format.header import ModelHeader
from tinyloop.runtime.continuation import continue_tokens
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.generate import GenerationStats, SamplingParams

H = TypeVar("H", bound=CacheHandle)


class CachingMixin:
    """Needs `_engine`, `header`, `path`, `max_seq_len`, `_check_open`, `_tokens`, `_loops` and
    `_generation_cache` from the Model, and `_init_caching` called by its constructor."""

    _engine: Engine
    header: ModelHeader
    path: Path
    max_seq_len: int
    last_stats: GenerationStats
    kv: KVModeChoice

    def _check_open(self) -> None:
        raise NotImplementedError

    def _tokens(self, tokens: Any, name: str = "tokens") -> torch.Tensor:
        raise NotImplementedError

    def _loops(self, loops: int | None) -> int:
        raise NotImplementedError

    def _generation_cache(self, loops: int) -> ModeCache | None:
        raise NotImplementedError

    # ---- setup and metadata -------------------------------------------------------------------
    def _init_caching(self, env: RuntimeEnv, kv_mode: str | None, cache_window: int | None) -> None:
        self.kv = resolve_kv_mode(env, kv_mode, cache_window)
        self._handles: weakref.WeakSet[CacheHandle] = weakref.WeakSet()
        self._pools: weakref.WeakSet[PrefixPool] = weakref.WeakSet()
        self._identity: str | None = None

    def _release_handles(self) -> None:
        for handle in list(self._handles):
            handle._release("model")
        for pool in list(self._pools):
            pool.prune()

    def _handle_bytes(self) -> int:
        return sum(h.nbytes for h in list(self._handles))

    @property
    def kv_mode(self) -> str:
        """'16bit', 'int8', 'window', 'hidden' or 'none'."""
        return self.kv.mode

    @property
    def cache_window(self) -> int:
        """Positions a sliding-window cache keeps per slot (0: a full cache)."""
        return self.kv.window

    @property
    def cache_identity(self) -> str:
        """What caches are valid for: the weights (config, quantization, checksums), the compute dtype and
        the KV mode. Prefix caches, pools and resume handles only work with a model of the same identity."""
        self._check_open()
        if self._identity is None:
            h = self.header
            digest = hashlib.sha256(h.config.to_json().encode())
            digest.update(f"{h.quantization.bits}/{h.quantization.group_size}".encode())
            for name in sorted(h.checksums):
                digest.update(f"{name}={h.checksums[name]};".encode())
            dtype = str(self._engine.dtype).removeprefix("torch.")
            label = h.config.name or self.path.stem
            self._identity = f"{label}@{digest.hexdigest()[:16]}/{self.kv.describe()}/{dtype}"
        return self._identity

    def kv_bytes_per_token(self, loops: int | None = None) -> int:
        """Cache bytes one token of context costs at `loops` in this model's KV mode (0 in mode 'none';
        a sliding window holds at most cache_window such tokens)."""
        self._check_open()
        return kv_bytes_per_token(self.kv, self.header.config, self._loops(loops), self._engine.dtype)

    # ---- helpers ----------------------------------------------------------------------------------
    def _working_cache(self, loops: int, what: str) -> ModeCache:
        cache = self._generation_cache(loops)
        if cache is None:
            raise ValueError(
                f"{what} needs a KV cache, but this model runs with kv_mode 'none' (TINYLOOP_DISABLE_KV_CACHE=1); "
                "create the Model with another kv_mode"
            )
        return cache

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

    def _params(self, max_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> SamplingParams:
        from tinyloop.api.model import _sampling

        return _sampling(max_tokens, temperature, top_k, top_p, seed)

    def _check_room(self, tokens: int, max_tokens: int) -> None:
        if tokens + max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({tokens} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {self.max_seq_len}"
            )

    def _stream(
        self,
        cache: ModeCache | None,
        sequence: torch.Tensor,
        first: Callable[[], torch.Tensor],
        max_tokens: int,
        loops: int,
        params: SamplingParams,
    ) -> Iterator[int]:
        self.last_stats = GenerationStats()
        return continue_tokens(self._engine, cache, sequence, first, max_tokens, loops, params, self.last_stats)

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
        cache = self._working_cache(n_loops, "build_prefix_cache")
        out = self._run_prompt(ids, cache, n_loops)
        kv = cache.snapshot(int(ids.numel()), n_loops)
        logits = copy_out(out.logits[0, -1], "prefix logits")
        return self._own(PrefixCache(self.cache_identity, ids.numpy(), n_loops, kv, logits))

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
        params = self._params(max_tokens, temperature, top_k, top_p, seed)
        n = int(cache.tokens.size)
        self._check_room(n + int(suffix_ids.numel()), max_tokens)
        working = self._working_cache(n_loops, "generate_from_prefix_cache")
        kv, logits = cache.kv(), cache.last_logits()
        assert kv is not None

        def first() -> torch.Tensor:
            working.restore(kv, n, n_loops, n)
            if suffix_ids.numel() == 0:
                return logits
            out = self._engine.step(suffix_ids[None], working, n_loops, last_only=True)
            assert out.logits is not None
            return out.logits[0, -1]

        sequence = torch.cat((torch.from_numpy(cache.tokens.astype(np.int64)), suffix_ids))
        return self._stream(working, sequence, first, max_tokens, n_loops, params)

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
        n_loops = self._loops(loops)
        params = self._params(max_tokens, temperature, top_k, top_p, seed)
        n = int(ids.numel())
        self._check_room(n, max_tokens)
        working = self._working_cache(n_loops, "generate_with_pool")
        self._pools.add(pool)
        match = pool.lookup(ids.numpy(), n_loops, self.cache_identity, working.can_use)
        if match is None:

            def first() -> torch.Tensor:
                return self._run_prompt(ids, working, n_loops).logits[0, -1]

            return self._stream(working, ids, first, max_tokens, n_loops, params)
        item = self._checked(match.item, PrefixCache)
        kv, logits, length, reuse = item.kv(), item.last_logits(), int(item.tokens.size), match.reuse
        assert kv is not None

        def first_from_match() -> torch.Tensor:
            working.restore(kv, length, n_loops, reuse)
            if match.exact:
                return logits
            out = self._engine.step(ids[None, reuse:], working, n_loops, last_only=True)
            assert out.logits is not None
            return out.logits[0, -1]

        return self._stream(working, ids, first_from_match, max_tokens, n_loops, params)

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
        cache = self._generation_cache(n_loops)
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
        params = self._params(max_tokens, temperature, top_k, top_p, seed)
        ids = torch.from_numpy(handle.tokens.astype(np.int64))
        n = int(ids.numel())
        self._check_room(n, max_tokens)
        working = self._generation_cache(n_loops)
        kv, logits, state = handle.kv(), handle.last_logits(), handle.state()

        def first() -> torch.Tensor:
            if working is not None:
                assert kv is not None
                working.restore(kv, n, handle.loops, n)
            if n_loops == handle.loops:
                return logits
            out = self._engine.step(
                ids[None], working, n_loops, start=torch.zeros(1, dtype=torch.long), resume=state,
                start_loop=handle.loops, last_only=True,
            )  # fmt: skip
            assert out.logits is not None
            return out.logits[0, -1]

        return self._stream(working, ids, first, max_tokens, n_loops, params)

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
