"""Text of a byte-level model (the built-in `tiny`): its token ids are the UTF-8 bytes of the text."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tinyloop.errors import ArgumentTypeError


class ByteTokenizer:
    """The byte vocabulary's encode / decode, with EmbeddedTokenizer's interface.

    Ids 0-255 are bytes; ids above (a vocabulary padded past 256) have no text and decode to nothing.
    Bytes that are not valid UTF-8 decode to U+FFFD.
    """

    stop_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_bos: bool | None = None) -> np.ndarray:
        if not isinstance(text, str):
            raise ArgumentTypeError(f"text must be a str, got {type(text).__name__}")
        if add_bos:
            raise ValueError("a byte-level model has no bos token; leave add_bos None or False")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> np.ndarray:
        raise ValueError("a byte-level model has no chat template; pass the prompt as a str")

    def incremental(self, skip_special_tokens: bool = False) -> ByteDecoder:
        return ByteDecoder()


class ByteDecoder:
    """Ids to text pieces; a multi-byte character comes out whole once its last byte arrives."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(bytes((token,))) if token < 256 else ""

    def flush(self) -> str:
        """What is left (U+FFFD when the stream stopped inside a character)."""
        return self._utf8.decode(b"", final=True)
