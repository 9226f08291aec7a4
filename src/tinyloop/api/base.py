"""`ModelBase`: what every part of the public `Model` shares — loading, lifecycle, argument checks,
the request parameters (`SamplingParams`) and the pool of working caches requests check out."""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from tinyloop import log
from tinyloop.api.arguments import checked_loops, compute_dtype
from tinyloop.api.decoding import depth_schedule, finish_stream, grammar_index, model_vocab
from tinyloop.api.handles import CacheHandle
from tinyloop.api.tokens import as_token_array
from tinyloop.builtin import resolve_model
from tinyloop.cache.base import ModeCache
from tinyloop.cache.factory import KVModeChoice, make_cache, resolve_kv_mode
from tinyloop.cache.pool import PrefixPool
from tinyloop.env import RuntimeEnv
from tinyloop.errors import ModelClosedError
from tinyloop.format.header import read_header
from tinyloop.format.tokenizer_meta import parse_tokenizer_meta
from tinyloop.kernels import l2_residency
from tinyloop.model.weights import weight_bytes
from tinyloop.runtime.decode import Row, decode_row
from tinyloop.runtime.loader import load_engine, pick_device
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.stats import GenerationStats
from tinyloop.sampling import SamplingParams
from tinyloop.stochastic.weight import CrossIterRound
from tinyloop.text.bytes import ByteTokenizer
from tinyloop.text.tokenizer import EmbeddedTokenizer

MiB = 1 << 20
# max_seq_len when none is given (or the model's max_position, if smaller).
DEFAULT_MAX_SEQ_LEN = 2048
# Idle working caches kept for reuse (a request checks one out; concurrent requests get their own).
IDLE_CACHES = 2


class ModelBase:
    """A loaded model: the engine, its metadata, and the state requests share (see `Model`)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_seq_len: int | None = None,
        device: str | torch.device | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        kv_mode: str | None = None,
        cache_window: int | None = None,
        cross_iter_round: bool | None = None,
        cross_iter_seed: int = 0,
    ) -> None:
        if max_seq_len is not None and (
            isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0
        ):
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        self._closed = True
        self.path = resolve_model(path)
        max_position = read_header(self.path).config.max_position
        if max_seq_len is None:
            max_seq_len = min(DEFAULT_MAX_SEQ_LEN, max_position)
        elif max_seq_len > max_position:
            raise ValueError(
                f"max_seq_len must be in [1, {max_position}] (the model's max_position), got {max_seq_len}"
            )
        self.env = RuntimeEnv.read()
        self.kv: KVModeChoice = resolve_kv_mode(self.env, kv_mode, cache_window)
        self._handles: weakref.WeakSet[CacheHandle] = weakref.WeakSet()
        self._pools: weakref.WeakSet[PrefixPool] = weakref.WeakSet()
        self._identity: str | None = None
        self._idle_caches: list[ModeCache] = []
        self._busy_caches: weakref.WeakSet[Any] = weakref.WeakSet()
        self._cache_lock = threading.Lock()
        self._text_tokenizer: EmbeddedTokenizer | None = None
        self.device = pick_device(device)
        dtype = compute_dtype(dtype, self.device)
        round_on = self.env.cross_iter_round if cross_iter_round is None else bool(cross_iter_round)
        rounding = CrossIterRound(cross_iter_seed, require_channels=cross_iter_round is True)
        self.header, self._engine = load_engine(
            self.path, self.device, dtype, rounding if round_on else None, max_positions=max_seq_len
        )
        cfg = self.header.config
        self._max_seq_len = max_seq_len
        self._closed = False
        self.last_stats = GenerationStats()
        q = self.header.quantization
        log.info(
            f"{self.path.name}: format {self.header.format_version_str}, {q.bits}-bit, d={cfg.d_model}, "
            f"heads={cfg.n_heads}/{cfg.n_kv_heads}, layers={cfg.n_prelude}+{cfg.n_body}x L+{cfg.n_coda}, "
            f"default L={cfg.default_loops}, vocab={cfg.vocab_size}, device={self.device}"
        )
        log.info(f"memory: weights {weight_bytes(self._engine.weights) / MiB:.1f} MiB on {self.device}")

    # ---- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free weights and caches; any later call (and any open stream) raises RuntimeError('model was closed')."""
        if not self._closed:
            self._closed = True
            with self._cache_lock:
                self._idle_caches.clear()
            for handle in list(self._handles):
                handle._release("model")
            for pool in list(self._pools):
                pool.prune()
            kept_in_l2 = self._engine.l2_window is not None
            with self._engine.lock:  # let a step running in another thread finish first
                self._engine.close()
            del self._engine
            if self.device.type == "cuda":
                if kept_in_l2:
                    _release_l2_lines()
                torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_seq_len(self) -> int:
        """The longest sequence (prompt + generated tokens) a call may use; position tables hold this many."""
        return self._max_seq_len

    @max_seq_len.setter
    def max_seq_len(self, value: int) -> None:
        self._check_open()
        limit = self.header.config.max_position
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise ValueError(
                f"max_seq_len must be an integer in [1, {limit}] (the model's max_position), got {value!r}"
            )
        if value > self._engine.max_positions:
            self._engine.reserve_positions(value)
        with self._cache_lock:
            self._idle_caches.clear()  # sized for the old length
        self._max_seq_len = value

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError()

    # ---- argument checks ----------------------------------------------------------------------
    def _loops(self, loops: int | None) -> int:
        return checked_loops(loops, self.header.config)

    def _tokens(self, tokens: Any, name: str = "tokens") -> torch.Tensor:
        arr = as_token_array(tokens, self.header.config.vocab_size, name)
        if arr.size > self.max_seq_len:
            raise ValueError(f"{name} has {arr.size} tokens, more than max_seq_len {self.max_seq_len}")
        return torch.from_numpy(arr.astype(np.int64))

    def _params(self, **arguments: Any) -> SamplingParams:
        """The request's SamplingParams (loops resolved to the model's default), checked against the model."""
        params = SamplingParams(**arguments)
        params.check_vocab(self.header.config.vocab_size)
        return params.with_loops(self._loops(params.loops))

    def _check_room(self, tokens: int, max_tokens: int) -> None:
        if tokens + max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({tokens} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {self.max_seq_len}"
            )

    def _stream(self, ids: torch.Tensor, params: SamplingParams, text: bool) -> Iterator[Any]:
        """The token stream of one request (validated arguments); its cache is taken on the first next()."""
        self._check_room(int(ids.numel()), params.max_tokens)
        assert params.loops is not None
        schedule = depth_schedule(params.l_warmup_tokens, params.l_warmup_loops, params.loops)
        cfg = self.header.config
        needs_vocab = params.grammar is not None or params.stop or text
        vocab = model_vocab(cfg, self._tokenizer_json()) if needs_vocab else None
        index = grammar_index(params.grammar, vocab, self._engine.device) if vocab is not None else None
        self.last_stats = stats = GenerationStats()
        engine = self._engine

        def tokens() -> Iterator[int]:
            assert params.loops is not None
            with self._request_cache(params.loops) as cache:
                picker = TokenPicker(params, index, params.stop_tokens)
                yield from decode_row(engine, cache, Row(ids, params.loops, params.max_tokens, picker, schedule, stats))

        return finish_stream(tokens(), vocab, list(params.stop), text, stats)

    # ---- working caches -----------------------------------------------------------------------
    @contextmanager
    def _request_cache(self, loops: int, batch: int = 1, what: str = "") -> Iterator[ModeCache | None]:
        """A working cache owned by one request while the block runs: taken from the idle ones (or newly
        allocated), given back afterwards — unless the request failed, since a failed step may have left
        non-finite values in it. `what` names a caller that cannot run without a cache (mode 'none')."""
        if self.kv.mode == "none":
            if what:
                raise ValueError(
                    f"{what} needs a KV cache, but this model runs with kv_mode 'none' "
                    "(TINYLOOP_DISABLE_KV_CACHE=1); create the Model with another kv_mode"
                )
            yield None
            return
        cache = self._take_cache(loops, batch)
        ok = False
        try:
            yield cache
            ok = True
        except GeneratorExit:  # the caller stopped early: the cache is sound
            ok = True
            raise
        finally:
            with self._cache_lock:
                self._busy_caches.discard(cache)
                if ok and not self._closed and batch == 1:
                    self._idle_caches.append(cache)
                    del self._idle_caches[:-IDLE_CACHES]

    def _take_cache(self, loops: int, batch: int) -> ModeCache:
        with self._cache_lock:
            if batch == 1:
                for i, cache in enumerate(self._idle_caches):
                    if cache.loops >= loops:
                        del self._idle_caches[i]
                        self._busy_caches.add(cache)
                        return cache
                self._idle_caches.clear()  # smaller than asked: free them before allocating
        cfg, engine = self.header.config, self._engine
        made = make_cache(self.kv, cfg, batch, self.max_seq_len, loops, engine.device, engine.dtype)
        assert made is not None
        with self._cache_lock:
            self._busy_caches.add(made)
        return made

    def _cache_bytes(self) -> int:
        with self._cache_lock:
            caches = list(self._idle_caches) + list(self._busy_caches)
        return sum(c.nbytes for c in caches)

    # ---- handles ----------------------------------------------------------------------------------
    def _handle_bytes(self) -> int:
        return sum(h.nbytes for h in list(self._handles))

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

    # ---- tokenizer ------------------------------------------------------------------------------
    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer" in self.header.metadata

    @property
    def tokenizer(self) -> EmbeddedTokenizer:
        """The embedded tokenizer (ValueError when the file has none)."""
        self._check_open()
        if self._text_tokenizer is None:
            text = self.header.metadata.get("tokenizer")
            if text is None:
                raise ValueError(
                    "this model has no embedded tokenizer; convert it from a folder with tokenizer.json, "
                    "or pass token ids"
                )
            meta = parse_tokenizer_meta(text, self.header.config.vocab_size)
            self._text_tokenizer = EmbeddedTokenizer(meta, self.header.config.vocab_size)
        return self._text_tokenizer

    def _text_codec(self) -> EmbeddedTokenizer | ByteTokenizer:
        """The embedded tokenizer, or for a byte-level model without one its bytes as UTF-8."""
        if self.header.config.tokenizer == "bytes" and not self.has_tokenizer:
            self._check_open()
            return ByteTokenizer()
        return self.tokenizer

    def _tokenizer_json(self) -> dict[str, Any] | None:
        """The embedded tokenizer's tokenizer.json (None for byte models): the hook grammars and stop
        strings use to map token ids to bytes."""
        if self.header.config.tokenizer == "bytes" or not self.has_tokenizer:
            return None
        return self.tokenizer.meta.tokenizer_json


def _release_l2_lines() -> None:
    try:
        l2_residency.release_persisting_lines()
    except l2_residency.DriverError as exc:
        log.info(f"L2 residency: persisting lines not released on close ({exc})")
