"""Token id -> bytes tables: what text each vocabulary entry stands for (byte vocabularies, BPE)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenVocab:
    """pieces[i] is the byte string of token i; None marks a token with no text (special, unused).

    `key` identifies the table cheaply, so compiled grammars can be cached per vocabulary.
    """

    pieces: tuple[bytes | None, ...]
    key: str

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes | None], key: str | None = None) -> TokenVocab:
        table = tuple(None if p is None or p == b"" else bytes(p) for p in pieces)
        return cls(table, key if key is not None else f"pieces:{hash(table):x}:{len(table)}")

    @classmethod
    def bytes_vocab(cls, vocab_size: int) -> TokenVocab:
        """Ids 0..255 are the bytes; any ids past 255 have no text."""
        pieces = [bytes((i,)) if i < 256 else None for i in range(vocab_size)]
        return cls(tuple(pieces), f"bytes:{vocab_size}")

    def __len__(self) -> int:
        return len(self.pieces)

    def piece(self, token: int) -> bytes:
        p = self.pieces[token] if 0 <= token < len(self.pieces) else None
        return b"" if p is None else p

    def decode_bytes(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.piece(int(t)) for t in tokens)


def byte_level_pieces(vocab: dict[str, int]) -> list[bytes | None]:
    """Pieces of a byte-level BPE vocabulary (GPT-2 style: each byte is stored as a printable character)."""
    decode = {ch: b for b, ch in _byte_to_unicode().items()}
    pieces: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    for text, idx in vocab.items():
        if all(ch in decode for ch in text):
            pieces[idx] = bytes(decode[ch] for ch in text)
    return pieces


def _byte_to_unicode() -> dict[int, str]:
    # Printable Latin-1 bytes map to themselves; the other bytes take the code points from 256 upward, in order.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def vocab_from_tokenizer_json(tokenizer_json: dict[str, Any], vocab_size: int) -> TokenVocab:
    """Pieces of a Hugging Face tokenizer.json: byte-level BPE, or byte-fallback (`<0xNN>`, '▁' = space).

    Added/special tokens have no text. Other tokenizer kinds are a ValueError.
    """
    model = tokenizer_json.get("model") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise ValueError("the tokenizer has no token -> id vocabulary; constrained decoding needs one")
    special = {t.get("id") for t in tokenizer_json.get("added_tokens") or [] if t.get("special", True)}
    decoder = json.dumps(tokenizer_json.get("decoder"))
    pieces: list[bytes | None] = [None] * vocab_size
    if "ByteLevel" in decoder:
        for i, p in enumerate(byte_level_pieces(vocab)):
            if i < vocab_size:
                pieces[i] = p
    elif model.get("byte_fallback") or "ByteFallback" in decoder:
        for text, idx in vocab.items():
            if 0 <= idx < vocab_size:
                m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text)
                pieces[idx] = bytes((int(m.group(1), 16),)) if m else text.replace("▁", " ").encode("utf-8")
    else:
        raise ValueError("unsupported tokenizer kind for constrained decoding (need byte-level or byte-fallback)")
    for idx in special:
        if isinstance(idx, int) and 0 <= idx < vocab_size:
            pieces[idx] = None
    return TokenVocab.from_pieces(pieces, key=f"tokenizer:{hash(tuple(pieces)):x}")
