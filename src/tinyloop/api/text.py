"""Model methods for text and for the looped families' exit mechanisms (embedded tokenizer, Ouro gate,
per-token adaptive depth)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tinyloop.api.base import ModelBase
from tinyloop.api.tokens import as_token_array
from tinyloop.runtime.adaptive_exit import ExitCriterion, FamilyStats
from tinyloop.runtime.family_exit import ExitRule, check_supported, exit_logits
from tinyloop.runtime.family_generate import stream_family
from tinyloop.sampling import SamplingParams


def _exit_rule(exit_threshold: Any, exit_at_step: Any, weighted_exit: Any) -> ExitRule:
    p = SamplingParams(exit_threshold=exit_threshold, exit_at_step=exit_at_step, weighted_exit=weighted_exit)
    return ExitRule(p.exit_threshold, p.exit_at_step, p.weighted_exit)


class TextMixin(ModelBase):
    """Text in and out (the embedded tokenizer) and the looped families' exit mechanisms."""

    last_family_stats: FamilyStats | None = None

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
        embedded tokenizer (the stop token is not yielded, as everywhere).
        """
        self._check_open()
        ids = self._tokens(prompt, "prompt")
        params = self._params(
            max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            exit_threshold=exit_threshold, exit_at_step=exit_at_step, weighted_exit=weighted_exit,
            exit_criterion=exit_criterion, exit_tol=exit_tol, min_loops=min_loops,
        )  # fmt: skip
        n = params.loops
        assert n is not None
        rule = ExitRule(params.exit_threshold, params.exit_at_step, params.weighted_exit)
        crit = None
        if params.exit_criterion is not None:
            crit = ExitCriterion(params.exit_criterion, params.exit_tol, params.min_loops)
        if ids.numel() + int(max_tokens) > self.max_seq_len:
            raise ValueError(
                f"prompt ({ids.numel()} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {self.max_seq_len}"
            )
        stops = self.tokenizer.stop_ids if stop and self.has_tokenizer else ()
        self.last_family_stats = stats = FamilyStats()
        engine = self._engine

        def tokens() -> Iterator[int]:
            with self._request_cache(n) as cache:
                yield from stream_family(engine, cache, ids, params.max_tokens, n, params, rule, crit, stops, stats)

        return tokens()

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
