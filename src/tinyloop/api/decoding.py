"""Argument checks and stream wrappers shared by generate, generate_stream and generate_speculative:
grammars, stop tokens and strings, depth schedules, text pieces."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tinyloop.grammar.grammar import Grammar
from tinyloop.grammar.index import TokenIndex
from tinyloop.grammar.vocab import TokenVocab, vocab_from_tokenizer_json
from tinyloop.runtime.depth_schedule import DepthSchedule
from tinyloop.runtime.stop_strings import StreamPiece, text_pieces, with_stop_strings


def model_vocab(cfg: Any, tokenizer_json: dict[str, Any] | None) -> TokenVocab:
    """The token -> bytes table: the byte vocabulary, or the embedded tokenizer's pieces."""
    if cfg.tokenizer == "bytes":
        return TokenVocab.bytes_vocab(cfg.vocab_size)
    if tokenizer_json is None:
        raise ValueError(
            "grammars and stop strings need a byte vocabulary or an embedded tokenizer; this model has neither"
        )
    return vocab_from_tokenizer_json(tokenizer_json, cfg.vocab_size)


def grammar_index(grammar: Any, vocab: TokenVocab, device: torch.device) -> TokenIndex | None:
    if grammar is None:
        return None
    if isinstance(grammar, str):
        grammar = Grammar(grammar)
    if not isinstance(grammar, Grammar):
        raise ValueError(f"grammar must be a tinyloop.Grammar or a regex str, got {type(grammar).__name__}")
    return grammar.index(vocab, device)


def depth_schedule(l_warmup_tokens: Any, l_warmup_loops: Any, loops: int) -> DepthSchedule | None:
    for name, value, low in (("l_warmup_tokens", l_warmup_tokens, 0), ("l_warmup_loops", l_warmup_loops, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not l_warmup_tokens:
        return None
    if l_warmup_loops > loops:
        raise ValueError(f"l_warmup_loops ({l_warmup_loops}) must not exceed loops ({loops})")
    return DepthSchedule(int(l_warmup_tokens), int(l_warmup_loops))


def finish_stream(
    tokens: Iterator[int], vocab: TokenVocab | None, stops: list[bytes], text: bool, stats: Any
) -> Iterator[Any]:
    """Apply stop strings and text decoding to a token stream; sets stats.stop_reason on a stop string."""
    if not stops and not text:
        yield from tokens
        return
    assert vocab is not None

    def matched() -> None:
        stats.stop_reason = "stop_string"

    pairs = with_stop_strings(tokens, vocab, stops, matched)
    if text:
        yield from text_pieces(pairs)
    else:
        yield from (tok for tok, _ in pairs)


__all__ = ["StreamPiece"]
