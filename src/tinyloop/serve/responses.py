"""Response pieces in the OpenAI API's shapes: usage (with tinyloop's loops_per_token) and logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinyloop.runtime.stats import TokenLogprob
from tinyloop.serve.engine import RequestStats


def usage(prompt_tokens: int, stats: Sequence[RequestStats]) -> dict[str, Any]:
    """Token counts of a response (prompts counted once) and the mean loops per generated token."""
    generated = sum(s.generated_tokens for s in stats)
    loops = sum(s.loops_per_token * s.generated_tokens for s in stats)
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated,
        "loops_per_token": round(loops / generated, 4) if generated else 0.0,
    }  # fmt: skip


def _token_text(codec: Any, token: int) -> tuple[str, list[int]]:
    """A token's text and bytes (a byte model's token is one byte; a lone partial character shows as U+FFFD)."""
    if not hasattr(codec, "meta"):  # byte model
        raw = bytes((token,)) if token < 256 else b""
        return raw.decode("utf-8", errors="replace"), list(raw)
    text = codec.decode([token])
    return text, list(text.encode("utf-8"))


def chat_logprobs(codec: Any, pairs: Sequence[tuple[int, TokenLogprob]]) -> dict[str, Any]:
    content = []
    for token, rec in pairs:
        text, raw = _token_text(codec, token)
        top = []
        for alt, logprob in rec.top:
            alt_text, alt_raw = _token_text(codec, alt)
            top.append({"token": alt_text, "logprob": logprob, "bytes": alt_raw})
        content.append({"token": text, "logprob": rec.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(codec: Any, pairs: Sequence[tuple[int, TokenLogprob]], k: int | None) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token, rec in pairs:
        text, _ = _token_text(codec, token)
        tokens.append(text)
        token_logprobs.append(rec.logprob)
        top_logprobs.append({_token_text(codec, alt)[0]: logprob for alt, logprob in rec.top} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
