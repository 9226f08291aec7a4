"""Model methods for text and for the looped families' exit mechanisms (embedded tokenizer, Ouro gate,
per-token adaptive depth)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tinyloop.api.tokens import as_token_array
from tinyloop.format.header import ModelHeader
from tinyloop.format.tokenizer_meta import parse_tokenizer_meta
from tinyloop.runtime.adaptive_exit import ExitCriterion, FamilyStats, stream_family
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.family_exit import ExitRule, check_supported, exit_logits
from tinyloop.runtime.generate import SamplingParams
from tinyloop.text.bytes import ByteTokenizer
from tinyloop.text.tokenizer import EmbeddedTokenizer


def _exit_rule(exit_threshold: Any, exit_at_step: Any, weighted_exit: Any) -> ExitRule:
    if exit_threshold is not None and (
        isinstance(exit_threshold, bool) or not isinstance(exit_threshold, (int, float))
    ):
        raise ValueError(f"exit_threshold must be a number in [0, 1] or None, got {exit_threshold!r}")
    if exit_at_step is not None and (isinstance(exit_at_step, bool) or not isinstance(exit_at_step, (int, np.integer))):
        raise ValueError(f"exit_at_step must be an integer >= 0 or None, got {exit_at_step!r}")
    return ExitRule(
        None if exit_threshold is None else float(exit_threshold),
        None if exit_at_step is None else int(exit_at_step),
        bool(weighted_exit),
    )


def _criterion(exit_criterion: Any, exit_tol: Any, min_loops: Any) -> ExitCriterion | None:
    if exit_criterion is None:
        if exit_tol is not None:
            raise ValueError("exit_tol needs exit_criterion")
        return None
    if exit_tol is not None and (isinstance(exit_tol, bool) or not isinstance(exit_tol, (int, float))):
        raise ValueError(f"exit_tol must be a number, got {exit_tol!r}")
    return ExitCriterion(str(exit_criterion), None if exit_tol is None else float(exit_tol), min_loops)


def _params(max_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> SamplingParams:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    return SamplingParams(float(temperature), int(top_k), float(top_p), None if seed is None else int(seed))


class TextMixin:
    """Needs `header`, `_engine`, `max_seq_len`, `_check_open`, `_tokens` and `_loops` from the Model."""

    header: ModelHeader
    _engine: Engine
    max_seq_len: int
    _text_tokenizer: EmbeddedTokenizer | None = None
    last_family_stats: FamilyStats | None = None

    def _check_open(self) -> None:
        raise NotImplementedError

    def _tokens(self, tokens: Any, name: str = "tokens") -> torch.Tensor:
        raise NotImplementedError

    def _loops(self, loops: int | None) -> int:
        raise NotImplementedError

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

    def encode(self, text: str, add_bos: bool | None = None) -> np.ndarray:
        """Token ids (np.int32) of `text` with the embedded tokenizer (bos as the model's tokenizer says);
        for a byte-level model, its UTF-8 bytes."""
        return self._text_codec().encode(text, add_bos)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of token ids (np.int32 array or list); a byte-level model's bytes that are not UTF-8
        decode to U+FFFD."""
        tok = self._text_codec()
        return tok.decode(
            as_token_array(ids, self.header.config.vocab_size, "ids", allow_empty=True), skip_special_tokens
        )

    def chat_prompt(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> np.ndarray:
        """Token ids of a chat ([{"role": ..., "content": ...}]) under the model's chat template."""
        return self._text_codec().chat_prompt(messages, add_generation_prompt)

    # ---- exit rules in scoring ------------------------------------------------------------------
    def score_exit(
        self,
        tokens: Any,
        loops: int | None = None,
        exit_threshold: float | None = None,
        exit_at_step: int | None = None,
        weighted_exit: bool = False,
    ) -> np.ndarray:
        """Logits [T, V] read with Ouro's exit rules (all loops run, as in the reference): the first loop
        whose exit CDF >= exit_threshold, loop exit_at_step (0-based), or the p-weighted mix of every loop."""
        self._check_open()
        ids = self._tokens(tokens)
        n = self._loops(loops)
        rule = _exit_rule(exit_threshold, exit_at_step, weighted_exit)
        check_supported(self.header.config, rule, n)
        out = self._engine.step(ids[None], None, n, collect_states=not rule.is_last)
        return exit_logits(self._engine.weights, self.header.config, out, rule, slice(None))[0].float().cpu().numpy()

    # ---- generation -----------------------------------------------------------------------------
    def generate_tokens_stream(
        self,
        prompt: Any,
        max_tokens: int = 128,
        loops: int | None = None,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        exit_threshold: float | None = None,
        exit_at_step: int | None = None,
        weighted_exit: bool = False,
        exit_criterion: str | None = None,
        exit_tol: float | None = None,
        min_loops: int = 1,
        stop: bool = True,
    ) -> Iterator[int]:
        """New ids one at a time, with the family's exit mechanisms and stop tokens.

        exit_threshold / exit_at_step / weighted_exit: Ouro's rules (every loop runs). exit_criterion
        ('kl', 'entropy', 'argmax', 'latent', 'gate') with exit_tol (None: Huginn's defaults) and min_loops:
        each decode token stops iterating early (docs/FAMILIES.md). stop: end after a stop token of the
        embedded tokenizer (the stop token is yielded).
        """
        self._check_open()
        ids = self._tokens(prompt, "prompt")
        n = self._loops(loops)
        params = _params(max_tokens, temperature, top_k, top_p, seed)
        rule = _exit_rule(exit_threshold, exit_at_step, weighted_exit)
        crit = _criterion(exit_criterion, exit_tol, min_loops)
        if ids.numel() + int(max_tokens) > self.max_seq_len:
            raise ValueError(
                f"prompt ({ids.numel()} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {self.max_seq_len}"
            )
        stops = self.tokenizer.stop_ids if stop and self.has_tokenizer else ()
        self.last_family_stats = FamilyStats()
        return stream_family(self._engine, ids, int(max_tokens), n, params, rule, crit, stops, self.last_family_stats)

    def generate_tokens(
        self, prompt: Any, max_tokens: int = 128, loops: int | None = None, **kwargs: Any
    ) -> np.ndarray:
        """All new ids (np.int32) of generate_tokens_stream."""
        return np.fromiter(self.generate_tokens_stream(prompt, max_tokens, loops, **kwargs), dtype=np.int32)

    def generate_text_stream(
        self, prompt: str | Sequence[Any], max_tokens: int = 128, loops: int | None = None, **kwargs: Any
    ) -> Iterator[str]:
        """Text pieces of the continuation, decoded incrementally (multi-byte characters come out whole).

        prompt: a str (encoded with the embedded tokenizer; a byte-level model reads its UTF-8 bytes), or a
        list of chat messages ([{"role": ..., "content": ...}], rendered with the model's chat template).
        Generation stops at the family's end tokens, which are not part of the text. Other arguments as
        generate_tokens_stream.
        """
        tok = self._text_codec()
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        else:
            ids = tok.chat_prompt(prompt, add_generation_prompt=True)
        if ids.size == 0:
            raise ValueError("the prompt encodes to no tokens")
        stops = set(tok.stop_ids) if kwargs.get("stop", True) else set()
        decoder = tok.incremental()
        for token in self.generate_tokens_stream(ids, max_tokens, loops, **kwargs):
            if token in stops:
                break
            piece = decoder.push(token)
            if piece:
                yield piece
        rest = decoder.flush()
        if rest:
            yield rest

    def generate_text(
        self, prompt: str | Sequence[Any], max_tokens: int = 128, loops: int | None = None, **kwargs: Any
    ) -> str:
        """The continuation of `prompt` as text (see generate_text_stream)."""
        return "".join(self.generate_text_stream(prompt, max_tokens, loops, **kwargs))
