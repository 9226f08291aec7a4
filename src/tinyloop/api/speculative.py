"""Model.generate_speculative: self-speculative decoding (few loops draft, many loops verify)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyloop.api.arguments import checked_loops
from tinyloop.api.base import ModelBase
from tinyloop.api.decoding import depth_schedule, finish_stream, grammar_index, model_vocab
from tinyloop.runtime.speculative import SpecConfig, SpeculativeStats, speculative_tokens


@dataclass(frozen=True)
class SpeculativeResult:
    """tokens: the new ids (np.int32); stats: drafted/accepted counts, verify passes, timings, stop_reason
    (as GenerationStats) and finished (False when a grammar was left in a non-accepting state at max_tokens)."""

    tokens: np.ndarray
    stats: SpeculativeStats

    @property
    def acceptance_rate(self) -> float:
        return self.stats.acceptance_rate

    @property
    def tokens_per_verify(self) -> float:
        return self.stats.tokens_per_verify

    @property
    def time_s(self) -> float:
        return self.stats.time_s


class SpeculativeMixin(ModelBase):
    """generate_speculative and its stream."""

    last_speculative_stats: SpeculativeStats

    def generate_speculative_stream(
        self,
        prompt: Any,
        max_tokens: int = 50,
        draft_loops: int = 2,
        verify_loops: int = 8,
        draft_ahead: int = 4,
        temperature: float = 0.0,
        top_k: int = 50,
        top_p: float = 0.9,
        seed: int | None = None,
        adaptive: bool = True,
        *,
        grammar: Any = None,
        stop_tokens: Any = None,
        stop: Any = None,
        l_warmup_tokens: int = 0,
        l_warmup_loops: int = 2,
        text: bool = False,
    ) -> Iterator[Any]:
        """generate_speculative one token at a time (ids, or StreamPiece(token, text) with text=True, as
        generate_stream); `last_speculative_stats` fills in as it runs. Closing the iterator ends generation."""
        self._check_open()
        ids = self._tokens(prompt, "prompt")
        for name, value in (("draft_loops", draft_loops), ("verify_loops", verify_loops), ("draft_ahead", draft_ahead)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        checked_loops(verify_loops, self.header.config, "verify_loops")
        params = self._params(
            max_tokens=max_tokens, loops=int(verify_loops), temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop_tokens=stop_tokens, stop=stop, grammar=grammar, l_warmup_tokens=l_warmup_tokens,
            l_warmup_loops=l_warmup_loops,
        )  # fmt: skip
        if draft_loops >= verify_loops:
            raise ValueError(f"draft_loops ({draft_loops}) must be smaller than verify_loops ({verify_loops})")
        if ids.numel() + max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({ids.numel()} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {self.max_seq_len}"
            )
        if self.kv.mode == "window":
            raise ValueError(
                f"speculative decoding cannot use a sliding-window KV cache (cache_window={self.kv.window}): "
                "rejected drafts are rolled back, but the ring has already overwritten the positions they "
                "replaced; use cache_window=0"
            )
        if self.kv.mode == "none":
            raise ValueError("speculative decoding needs a KV cache (unset TINYLOOP_DISABLE_KV_CACHE / kv_mode 'none')")
        cfg = self.header.config
        schedule = depth_schedule(params.l_warmup_tokens, params.l_warmup_loops, int(verify_loops))
        needs_vocab = params.grammar is not None or params.stop or text
        vocab = model_vocab(cfg, self._tokenizer_json()) if needs_vocab else None
        index = grammar_index(params.grammar, vocab, self._engine.device) if vocab is not None else None
        spec = SpecConfig(int(draft_loops), int(verify_loops), int(draft_ahead), bool(adaptive))
        self.last_speculative_stats = stats = SpeculativeStats()
        engine = self._engine

        def tokens() -> Iterator[int]:
            with self._request_cache(spec.verify_loops) as cache:
                assert cache is not None
                yield from speculative_tokens(
                    engine, cache, ids, params.max_tokens, spec, params, stats,
                    grammar=index, stop_tokens=params.stop_tokens, schedule=schedule,
                )  # fmt: skip

        return finish_stream(tokens(), vocab, list(params.stop), bool(text), stats)

    def generate_speculative(
        self,
        prompt: Any,
        max_tokens: int = 50,
        draft_loops: int = 2,
        verify_loops: int = 8,
        draft_ahead: int = 4,
        temperature: float = 0.0,
        top_k: int = 50,
        top_p: float = 0.9,
        seed: int | None = None,
        adaptive: bool = True,
        *,
        grammar: Any = None,
        stop_tokens: Any = None,
        stop: Any = None,
        l_warmup_tokens: int = 0,
        l_warmup_loops: int = 2,
    ) -> SpeculativeResult:
        """New tokens drafted at `draft_loops` and verified at `verify_loops`, with the same weights.

        Greedy output equals generate(..., loops=verify_loops, temperature=0) with the same grammar,
        stop_tokens, stop strings and depth schedule (l_warmup_tokens / l_warmup_loops: the warm-up steps
        run plain and shallow, speculation starts after them); with temperature > 0 drafts are accepted
        by rejection sampling, so the output is distributed as plain sampling at verify_loops (same
        temperature/top_k/top_p). adaptive: the draft length grows after fully accepted rounds, shrinks
        after rejections, and speculation pauses for plain steps while it would be slower, judged on the
        CPU by the times of its own plain, draft and verify steps (on CUDA, and for a seeded sampled request
        so that it repeats, by a layer-count cost model). Needs a rewindable KV cache (not cache_window > 0).
        """
        stream = self.generate_speculative_stream(
            prompt, max_tokens, draft_loops, verify_loops, draft_ahead, temperature, top_k, top_p, seed, adaptive,
            grammar=grammar, stop_tokens=stop_tokens, stop=stop, l_warmup_tokens=l_warmup_tokens,
            l_warmup_loops=l_warmup_loops,
        )  # fmt: skip
        tokens = np.fromiter(stream, dtype=np.int32)
        return SpeculativeResult(tokens, self.last_speculative_stats)
