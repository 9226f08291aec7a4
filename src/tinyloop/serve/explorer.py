"""The explorer's JSON endpoints (`POST /v1/lens`, `POST /v1/trajectory`) and its page at `/`.

Both endpoints score one sequence with the model's public introspection calls (`score_logit_lens`,
`score_with_uncertainty`, `score_trajectory`). The Scheduler has no scoring path, so these calls do not go
through it; they take the model's step lock like every other call, so they interleave with the batched
decode steps without touching any request's cache rows (see README, thread safety).

Token text: `text` is the token decoded alone; a token that is only part of a UTF-8 character (a byte of a
byte model, a byte-fallback or byte-level BPE piece) has `text` written as its bytes in hex (`\\xE2\\x82`)
and `partial: true`. `bytes` holds the token's raw bytes whenever they are known.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

STATIC = Path(__file__).absolute().parent / "static"
MAX_TOP_K = 20
LENS_CHUNK = 64  # positions whose float64 probabilities are held at once


class LensRequest(BaseModel):
    """A sequence (prompt text or token ids) and how deep to read it."""

    model: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    loops: int | None = Field(default=None, ge=1)
    top_k: int = Field(default=5, ge=1, le=MAX_TOP_K)


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """The printable stand-ins byte-level BPE vocabularies use for bytes (GPT-2's scheme)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in kept}
    extra = 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _tokenizer_bytes(codec: Any, token: int) -> bytes | None:
    """A tokenizer token's raw bytes, when its vocabulary entry spells them (byte fallback, byte-level BPE)."""
    piece = codec._tok.id_to_token(token)
    if piece is None:
        return None
    match = _BYTE_FALLBACK.match(piece)
    if match:
        return bytes((int(match.group(1), 16),))
    table = _byte_level_table()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return None


def token_info(codec: Any, token: int) -> dict[str, Any]:
    """{"id", "text", "bytes", "partial"} of one token (see the module docstring)."""
    if not hasattr(codec, "meta"):  # byte model: token = byte (ids past 255 are special and have no text)
        raw: bytes | None = bytes((token,)) if token < 256 else b""
        text = None
    else:
        text = codec.decode([token])
        raw = text.encode("utf-8") if "\ufffd" not in text else _tokenizer_bytes(codec, token)
    if raw is not None:
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError:
            hexed = "".join(f"\\x{b:02X}" for b in raw)
            return {"id": token, "text": hexed, "bytes": list(raw), "partial": True}
        text = decoded if text is None or "\ufffd" in text else text
    return {"id": token, "text": text or "", "bytes": list(raw) if raw is not None else None, "partial": False}


def sequence_ids(model: Any, codec: Any, req: LensRequest) -> np.ndarray:
    """The request's token ids; ValueError names what is wrong."""
    if (req.prompt is None) == (req.tokens is None):
        raise ValueError("give either prompt (text) or tokens (ids)")
    ids = codec.encode(req.prompt) if req.prompt is not None else np.asarray(req.tokens, dtype=np.int64)
    vocab = model.config["vocab_size"]
    if ids.size == 0:
        raise ValueError("the sequence must hold at least one token")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab})")
    return np.asarray(ids, dtype=np.int32)


def lens_report(model: Any, codec: Any, ids: np.ndarray, loops: int | None, top_k: int) -> dict[str, Any]:
    """The logit lens of `ids`: for every position (the prediction of the NEXT token) and every iteration,
    the top_k tokens with probabilities, the entropy (nats), KL(this || previous iteration) (nats; None at
    the first) and whether the top-1 changed from the previous iteration."""
    logits = model.score_logit_lens(ids, loops=loops)  # [L, T, V] float32
    n_loops, length, vocab = logits.shape
    k = min(top_k, vocab)
    entropy = np.empty((n_loops, length))
    kl = np.empty((n_loops - 1, length))
    top = np.empty((n_loops, length, k), dtype=np.int64)
    top_probs = np.empty((n_loops, length, k))
    for start in range(0, length, LENS_CHUNK):  # float64 temporaries for a few positions at a time
        span = slice(start, start + LENS_CHUNK)
        block = logits[:, span].astype(np.float64)
        logp = _log_softmax(block)
        probs = np.exp(logp)
        entropy[:, span] = -(probs * logp).sum(-1)
        kl[:, span] = (probs[1:] * (logp[1:] - logp[:-1])).sum(-1)
        candidates = np.argpartition(-block, k - 1, axis=-1)[..., :k]
        order = np.argsort(-np.take_along_axis(block, candidates, -1), axis=-1, kind="stable")
        top[:, span] = np.take_along_axis(candidates, order, -1)
        top_probs[:, span] = np.take_along_axis(probs, top[:, span], -1)
    infos: dict[int, dict[str, Any]] = {}

    def info(token: int) -> dict[str, Any]:
        if token not in infos:
            infos[token] = token_info(codec, token)
        return infos[token]

    top1 = top[..., 0]  # [L, T]
    changed = np.zeros_like(top1, dtype=bool)
    changed[1:] = top1[1:] != top1[:-1]
    # settled_at: the first iteration (1-based) from which the top-1 never changes again
    last_change = np.where(changed.any(0), n_loops - 1 - np.argmax(changed[::-1], axis=0), 0)
    positions = []
    for t in range(length):
        rows = []
        for i in range(n_loops):
            tops = [{**info(int(j)), "prob": float(p)} for j, p in zip(top[i, t], top_probs[i, t], strict=True)]
            kl_prev = float(kl[i - 1, t]) if i > 0 else None
            rows.append({"top": tops, "entropy": float(entropy[i, t]), "kl_prev": kl_prev,
                         "top1_changed": bool(changed[i, t])})  # fmt: skip
        positions.append({"iterations": rows, "top1_changes": int(changed[:, t].sum()),
                          "settled_at": int(last_change[t]) + 1})  # fmt: skip
    return {"object": "lens", "loops": n_loops, "top_k": k, "tokens": [info(int(t)) for t in ids],
            "positions": positions}  # fmt: skip


def trajectory_report(model: Any, codec: Any, ids: np.ndarray, loops: int | None) -> dict[str, Any]:
    """How the state moves across depth: per iteration and position, the hidden state's norm and its
    relative change from the previous iteration; KL between consecutive iterations' outputs
    (score_with_uncertainty) and the final output's entropy."""
    states = model.score_trajectory(ids, loops=loops).astype(np.float64)  # [2 + L, T, d]
    scores = model.score_with_uncertainty(ids, loops=loops)
    core = states[1:]  # the prelude's output, then each iteration's state
    norm = np.linalg.norm(core[1:], axis=-1)
    step = np.linalg.norm(core[1:] - core[:-1], axis=-1) / np.maximum(np.linalg.norm(core[:-1], axis=-1), 1e-30)
    return {"object": "trajectory", "loops": int(norm.shape[0]), "tokens": [token_info(codec, int(t)) for t in ids],
            "state_norm": norm.tolist(), "relative_step": step.tolist(), "kl": scores.kl.tolist(),
            "entropy": scores.entropy.tolist()}  # fmt: skip


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
