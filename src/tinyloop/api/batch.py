"""Model.generate_batch / generate_batch_stream: many requests decoded together in one batched step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import closing
from typing import Any

import numpy as np
import torch

from tinyloop.api.base import ModelBase
from tinyloop.api.decoding import depth_schedule, grammar_index, model_vocab
from tinyloop.cache.factory import make_cache
from tinyloop.grammar.vocab import TokenVocab
from tinyloop.runtime.decode import Row, decode_rows
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.stats import GenerationStats
from tinyloop.runtime.stop_strings import StopStringFilter
from tinyloop.sampling import SamplingParams

# Arguments whose per-row form is a sequence of per-row values; for stop and stop_tokens (whose own
# values may be lists) only a sequence of lists, tuples or None is read per row.
_LISTS = ("stop_tokens", "stop")


class BatchMixin(ModelBase):
    """Batched generation."""

    last_batch_stats: list[GenerationStats]

    def generate_batch_stream(
        self,
        prompts: Sequence[Any],
        max_tokens: Any = 128,
        loops: Any = None,
        temperature: Any = 0.8,
        top_k: Any = 50,
        top_p: Any = 1.0,
        seed: Any = None,
        *,
        stop_tokens: Any = None,
        stop: Any = None,
        grammar: Any = None,
        l_warmup_tokens: Any = 0,
        l_warmup_loops: Any = 2,
    ) -> Iterator[tuple[int, int]]:
        """Yield (row, token) as the rows generate them (arguments as in `generate_batch`).
        `last_batch_stats[row]` fills in as it runs. Closing the iterator ends every row."""
        self._check_open()
        ids = self._prompts(prompts)
        raw = {"max_tokens": max_tokens, "loops": loops, "temperature": temperature, "top_k": top_k,
               "top_p": top_p, "seed": seed, "stop_tokens": stop_tokens, "stop": stop, "grammar": grammar,
               "l_warmup_tokens": l_warmup_tokens, "l_warmup_loops": l_warmup_loops}  # fmt: skip
        per_row = _per_row(raw, len(ids))
        params = [self._params(**args) for args in per_row]
        for b, (row_ids, p) in enumerate(zip(ids, params, strict=True)):
            try:
                self._check_room(int(row_ids.numel()), p.max_tokens)
            except ValueError as exc:
                raise ValueError(f"prompts[{b}]: {exc}") from None
        if len(ids) == 1:  # one request: the single-request path (it reuses the model's idle working caches)
            stream = self._stream(ids[0], params[0], False)
            self.last_batch_stats = [self.last_stats]
            return ((0, token) for token in stream)
        needs_vocab = any(p.grammar is not None or p.stop for p in params)
        vocab = model_vocab(self.header.config, self._tokenizer_json()) if needs_vocab else None
        rows = []
        for row_ids, p in zip(ids, params, strict=True):
            assert p.loops is not None
            index = grammar_index(p.grammar, vocab, self._engine.device) if vocab is not None else None
            schedule = depth_schedule(p.l_warmup_tokens, p.l_warmup_loops, p.loops)
            rows.append(Row(row_ids, p.loops, p.max_tokens, TokenPicker(p, index, p.stop_tokens), schedule))
        self.last_batch_stats = [row.stats for row in rows]
        return self._batch_tokens(rows, params, vocab)

    def _batch_tokens(
        self, rows: list[Row], params: list[SamplingParams], vocab: TokenVocab | None
    ) -> Iterator[tuple[int, int]]:
        engine = self._engine
        filters = [StopStringFilter(vocab, p.stop) if p.stop and vocab is not None else None for p in params]
        # Rows that may produce nothing take no cache row; the others end at most max_tokens - 1 positions past
        # their prompt, where a finished one keeps rewriting its next position (nothing reads it).
        for row in rows:
            if row.max_tokens == 0:
                row.finish("max_tokens")
        live = [b for b, row in enumerate(rows) if not row.done]
        if not live:
            return
        max_seq = max(int(rows[b].prompt.numel()) + rows[b].max_tokens for b in live)
        loops = max(rows[b].loops for b in live)
        cache = make_cache(self.kv, self.header.config, len(live), max_seq, loops, engine.device, engine.dtype)
        # Closing this stream closes the loop's, which ends every row ("closed").
        with closing(decode_rows(engine, cache, [rows[b] for b in live])) as steps:
            for i, token in steps:
                b = live[i]
                flt = filters[b]
                if flt is None:
                    yield b, token
                    continue
                released = flt.feed(token)
                if flt.matched:
                    rows[b].finish("stop_string")
                yield from ((b, t) for t, _ in released)
        for b, flt in enumerate(filters):
            if flt is not None and not flt.matched:
                yield from ((b, t) for t, _ in flt.flush())

    def generate_batch(
        self,
        prompts: Sequence[Any],
        max_tokens: Any = 128,
        loops: Any = None,
        temperature: Any = 0.8,
        top_k: Any = 50,
        top_p: Any = 1.0,
        seed: Any = None,
        *,
        stop_tokens: Any = None,
        stop: Any = None,
        grammar: Any = None,
        l_warmup_tokens: Any = 0,
        l_warmup_loops: Any = 2,
    ) -> list[np.ndarray]:
        """New token ids (np.int32) for each prompt, all rows decoded together in one batched step.

        Each argument is one value for every row or a sequence with one value per row (for stop_tokens
        and stop: a list of per-row lists). Rows may differ in prompt length, max_tokens, loops, sampling
        parameters, seed, stops, grammar and depth schedule (l_warmup_tokens / l_warmup_loops, as in
        `generate`), and finish independently. Each row's tokens are those of the
        same request run alone with `generate` (greedy exactly; sampled exactly for the same seed on the
        CPU, where each row draws from its own generator).
        """
        stream = self.generate_batch_stream(
            prompts, max_tokens, loops, temperature, top_k, top_p, seed, stop_tokens=stop_tokens, stop=stop,
            grammar=grammar, l_warmup_tokens=l_warmup_tokens, l_warmup_loops=l_warmup_loops,
        )  # fmt: skip
        out: list[list[int]] = [[] for _ in self.last_batch_stats]
        for b, token in stream:
            out[b].append(token)
        return [np.asarray(tokens, dtype=np.int32) for tokens in out]

    def _prompts(self, prompts: Any) -> list[torch.Tensor]:
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of token sequences (or a 2-D array), got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("prompts must hold at least one prompt")
        return [self._tokens(p, f"prompts[{b}]") for b, p in enumerate(prompts)]


def _per_row(raw: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Split each argument into n per-row values (one value is repeated)."""
    columns: dict[str, list[Any]] = {}
    for name, value in raw.items():
        if name in _LISTS:
            per_row = (
                isinstance(value, (list, tuple))
                and bool(value)
                and all(v is None or isinstance(v, (list, tuple, np.ndarray)) for v in value)
            )
        else:
            per_row = isinstance(value, (list, tuple, np.ndarray))
        if not per_row:
            columns[name] = [value] * n
            continue
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} values for {n} prompts; give one value or one per prompt")
        columns[name] = list(value)
    return [{name: col[b] for name, col in columns.items()} for b in range(n)]
