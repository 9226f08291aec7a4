"""`Model`: the public handle on one loaded model — lifecycle, scoring, generation."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tinyloop import log
from tinyloop.api.arguments import checked_loops, compute_dtype
from tinyloop.api.caching import CachingMixin
from tinyloop.api.decoding import (
    depth_schedule,
    finish_stream,
    grammar_index,
    model_vocab,
    stop_string_list,
    stop_token_set,
)
from tinyloop.api.introspection import IntrospectionMixin
from tinyloop.api.speculative import SpeculativeMixin
from tinyloop.api.text import TextMixin
from tinyloop.api.tokens import as_token_array
from tinyloop.builtin import resolve_model
from tinyloop.cache.base import ModeCache
from tinyloop.cache.factory import make_cache
from tinyloop.env import RuntimeEnv
from tinyloop.errors import ModelClosedError
from tinyloop.kernels import l2_residency
from tinyloop.model.weights import weight_bytes
from tinyloop.runtime.generate import GenerationStats, SamplingParams, stream_tokens
from tinyloop.runtime.loader import load_engine, pick_device
from tinyloop.runtime.token_exit import report_token_exit, score_with_token_exit
from tinyloop.stochastic.weight import CrossIterRound

MiB = 1 << 20


class Model(IntrospectionMixin, CachingMixin, TextMixin, SpeculativeMixin):
    """A loaded `.tinyloop` model (or a built-in one, by name).

    Token inputs are 1-D np.ndarray[int32] (lists accepted; other dtypes only when lossless).
    dtype: torch.float32, torch.bfloat16 or torch.float16 (or its name); None picks float32 on the CPU and
    for models up to d=1024 on CUDA, else bfloat16. loops: 1 to MAX_LOOPS (1024) per call.
    kv_mode ('16bit', 'int8', 'window', 'hidden', 'none') and cache_window (0 = full cache) choose the
    KV cache; left None, TINYLOOP_KV_INT8 / TINYLOOP_KV_H_MODE / TINYLOOP_DISABLE_KV_CACHE decide.
    cross_iter_round: draw the looped INT4 weights afresh at each iteration from the file's rounding
    channels (tinyloop-add-sign-bit), reproducibly for `cross_iter_seed`; True refuses a file without
    channels; left None, TINYLOOP_CROSS_ITER_ROUND decides (and a file without channels runs as is).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_seq_len: int = 2048,
        device: str | torch.device | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        kv_mode: str | None = None,
        cache_window: int | None = None,
        cross_iter_round: bool | None = None,
        cross_iter_seed: int = 0,
    ) -> None:
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        self._closed = True
        self.path = resolve_model(path)
        self.env = RuntimeEnv.read()
        self._init_caching(self.env, kv_mode, cache_window)
        self.device = pick_device(device)
        dtype = compute_dtype(dtype, self.device)
        round_on = self.env.cross_iter_round if cross_iter_round is None else bool(cross_iter_round)
        rounding = CrossIterRound(cross_iter_seed, require_channels=cross_iter_round is True)
        self.header, self._engine = load_engine(self.path, self.device, dtype, rounding if round_on else None)
        cfg = self.header.config
        if max_seq_len > cfg.max_position:
            log.info(f"max_seq_len {max_seq_len} capped at the model's maximum position {cfg.max_position}")
            max_seq_len = cfg.max_position
        self.max_seq_len = max_seq_len
        self._cache: ModeCache | None = None
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
    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free weights and caches; any later call raises RuntimeError('model was closed')."""
        if not self._closed:
            self._closed = True
            self._cache = None
            self._release_handles()
            kept_in_l2 = self._engine.l2_window is not None
            self._engine.close()
            del self._engine
            if self.device.type == "cuda":
                if kept_in_l2:
                    _release_l2_lines()
                torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError()

    # ---- metadata ---------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        self._check_open()
        out = self.header.config.to_dict()
        out["format_version"] = self.header.format_version_str
        out["bits"] = self.header.quantization.bits
        out["group_size"] = self.header.quantization.group_size
        out["max_seq_len"] = self.max_seq_len
        out["device"] = str(self.device)
        return out

    def vram_usage_mb(self) -> float:
        """Bytes (MiB) this model holds on its device: weights, caches and the step workspace."""
        self._check_open()
        cfg = self.header.config
        total = weight_bytes(self._engine.weights) + self._engine.cos.nbytes + self._engine.sin.nbytes
        if self._engine.noise is not None:
            total += self._engine.noise.nbytes
        if self._cache is not None:
            total += self._cache.nbytes
        total += self._handle_bytes()
        # One decode step's live activations: hidden states, qkv, MLP, logits (float32 upper bound).
        total += 4 * (4 * cfg.d_model + cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.ffn_dim + cfg.vocab_size)
        # CUDA: what the captured decode graphs and the scoring scratch cache hold, as allocated.
        decoder = self._engine.decoder
        total += getattr(decoder, "graph_bytes", 0)
        scratch = getattr(decoder, "_scratch", None)
        if scratch is not None:
            total += scratch.nbytes
        return total / MiB

    # ---- argument checks ----------------------------------------------------------------------
    def _loops(self, loops: int | None) -> int:
        return checked_loops(loops, self.header.config)

    def _tokens(self, tokens: Any, name: str = "tokens") -> torch.Tensor:
        arr = as_token_array(tokens, self.header.config.vocab_size, name)
        if arr.size > self.max_seq_len:
            raise ValueError(f"{name} has {arr.size} tokens, more than max_seq_len {self.max_seq_len}")
        return torch.from_numpy(arr.astype(np.int64))

    # ---- scoring ------------------------------------------------------------------------------
    def _score_logits(self, tokens: Any, loops: int | None, token_exit: int | None, last_only: bool) -> torch.Tensor:
        self._check_open()
        ids = self._tokens(tokens)
        n_loops = self._loops(loops)
        patience = self.env.token_exit if token_exit is None else token_exit
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"token_exit must be an integer >= 0 (0 disables it), got {token_exit!r}")
        if patience:
            res = score_with_token_exit(self._engine, ids, n_loops, patience)
            if self.env.token_exit_verbose:
                report_token_exit(res)
            return res.logits[-1:] if last_only else res.logits
        out = self._engine.step(ids[None], None, n_loops, last_only=last_only)
        assert out.logits is not None
        return out.logits[0]

    def score(self, tokens: Any, loops: int | None = None, token_exit: int | None = None) -> np.ndarray:
        """Next-token logits at every position: float32 [T, V].

        token_exit=N (default: TINYLOOP_TOKEN_EXIT, 0 = off) lets each position stop iterating once its
        argmax has been unchanged for N consecutive loops.
        """
        return self._score_logits(tokens, loops, token_exit, last_only=False).float().cpu().numpy()

    def score_last(self, tokens: Any, loops: int | None = None, token_exit: int | None = None) -> np.ndarray:
        """Next-token logits after the last token: float32 [V]."""
        return self._score_logits(tokens, loops, token_exit, last_only=True)[-1].float().cpu().numpy()

    # ---- generation ------------------------------------------------------------------------------
    def _generation_cache(self, loops: int) -> ModeCache | None:
        if self.kv.mode == "none":
            return None
        if self._cache is None or self._cache.loops < loops:
            self._cache = None  # free the old buffers before allocating larger ones
            cfg, engine = self.header.config, self._engine
            self._cache = make_cache(self.kv, cfg, 1, self.max_seq_len, loops, engine.device, engine.dtype)
        return self._cache

    def generate_stream(
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
        text: bool = False,
    ) -> Iterator[Any]:
        """Yield new token ids one at a time (arguments as in `generate`); with text=True yield
        StreamPiece(token, text) instead (text decoded incrementally from the token bytes).

        Closing the iterator (or breaking out of a for loop) ends generation at once.
        """
        self._check_open()
        ids = self._tokens(prompt, "prompt")
        n_loops = self._loops(loops)
        params = _sampling(max_tokens, temperature, top_k, top_p, seed)
        if ids.numel() + max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({ids.numel()} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {self.max_seq_len}"
            )
        cfg = self.header.config
        stops = stop_token_set(stop_tokens, cfg.vocab_size)
        stop_strings = stop_string_list(stop)
        schedule = depth_schedule(l_warmup_tokens, l_warmup_loops, n_loops)
        vocab = model_vocab(cfg, self._tokenizer_json()) if grammar is not None or stop_strings or text else None
        index = grammar_index(grammar, vocab, self._engine.device) if vocab is not None else None
        cache = self._generation_cache(n_loops)
        self.last_stats = GenerationStats()
        tokens = stream_tokens(
            self._engine, cache, ids, max_tokens, n_loops, params, self.last_stats,
            grammar=index, stop_tokens=stops, schedule=schedule,
        )  # fmt: skip
        return finish_stream(tokens, vocab, stop_strings, bool(text), self.last_stats)

    def generate(
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
    ) -> np.ndarray:
        """New token ids (np.int32) after `prompt`. temperature 0 is greedy; a seed makes sampling repeat.

        stop_tokens: ids that end generation (not returned). stop: strings that end generation, matched
        on the generated bytes across token boundaries (not returned; a token straddling the start of
        one is kept). grammar: a tinyloop.Grammar (or regex str) the text must match; generation ends
        when nothing else can follow, and `last_stats.finished` is False if max_tokens cut it in a
        non-accepting state. l_warmup_tokens / l_warmup_loops: the first N decode steps run at M loops
        (see DepthSchedule for what deeper iterations then read). `last_stats.stop_reason` says why it ended.
        """
        stream = self.generate_stream(
            prompt, max_tokens, loops, temperature, top_k, top_p, seed, stop_tokens=stop_tokens, stop=stop,
            grammar=grammar, l_warmup_tokens=l_warmup_tokens, l_warmup_loops=l_warmup_loops,
        )  # fmt: skip
        return np.fromiter(stream, dtype=np.int32)

    def _tokenizer_json(self) -> dict[str, Any] | None:
        """The embedded tokenizer's tokenizer.json (None for byte models): the hook grammars and stop
        strings use to map token ids to bytes."""
        if self.header.config.tokenizer == "bytes" or not self.has_tokenizer:
            return None
        return self.tokenizer.meta.tokenizer_json

    def _sampling_params(self, max_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> SamplingParams:
        return _sampling(max_tokens, temperature, top_k, top_p, seed)


def _sampling(max_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> SamplingParams:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    return SamplingParams(float(temperature), int(top_k), float(top_p), None if seed is None else int(seed))


def load(
    path: str | os.PathLike[str],
    max_seq_len: int = 2048,
    device: str | torch.device | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    kv_mode: str | None = None,
    cache_window: int | None = None,
    cross_iter_round: bool | None = None,
    cross_iter_seed: int = 0,
) -> Model:
    """Alias of the Model constructor (same arguments)."""
    return Model(
        path, max_seq_len, device, dtype=dtype, kv_mode=kv_mode, cache_window=cache_window,
        cross_iter_round=cross_iter_round, cross_iter_seed=cross_iter_seed,
    )  # fmt: skip


__all__ = ["Model", "load"]


def _release_l2_lines() -> None:
    try:
        l2_residency.release_persisting_lines()
    except l2_residency.DriverError as exc:
        log.info(f"L2 residency: persisting lines not released on close ({exc})")
