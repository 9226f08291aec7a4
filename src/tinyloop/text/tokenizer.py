"""The tokenizer embedded in a `.tinyloop` file, through the `tokenizers` library."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tinyloop.format.tokenizer_meta import TokenizerMeta
from tinyloop.text.chat import render_chat


class EmbeddedTokenizer:
    """encode / decode / chat for one model; special ids come from the file's `tokenizer` metadata."""

    def __init__(self, meta: TokenizerMeta, vocab_size: int) -> None:
        from tokenizers import Tokenizer

        self.meta = meta
        self.vocab_size = vocab_size
        try:
            self._tok = Tokenizer.from_str(json.dumps(meta.tokenizer_json))
        except Exception as exc:  # the library raises a bare Exception on malformed JSON models
            raise ValueError(f"the embedded tokenizer cannot be loaded: {exc}") from None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.meta.stop_ids

    def encode(self, text: str, add_bos: bool | None = None) -> np.ndarray:
        """Token ids (np.int32) of `text`. Special-token text such as `<|im_end|>` becomes its id; the
        tokenizer's own post-processor is not applied; bos is prepended when the model asks for it."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.meta.add_bos if add_bos is None else add_bos) and self.meta.bos_id is not None:
            if not ids or ids[0] != self.meta.bos_id:
                ids = [self.meta.bos_id, *ids]
        arr = np.asarray(ids, dtype=np.int32)
        if arr.size and int(arr.max()) >= self.vocab_size:
            raise ValueError(f"the tokenizer produced id {int(arr.max())}, outside the model's vocabulary")
        return arr

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def chat_prompt(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> np.ndarray:
        text = render_chat(self.meta.chat_template, messages, add_generation_prompt)
        return self.encode(text, add_bos=False)  # templates write their own bos

    def incremental(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Turns a stream of ids into text pieces whose concatenation is the decode of all ids.

    A piece is released only when the text decoded so far does not end in U+FFFD, so a multi-byte
    character split over several byte-level tokens comes out whole. Each decode covers only the last
    released chunk (as context) and the ids after it.
    """

    def __init__(self, tokenizer: EmbeddedTokenizer, skip_special_tokens: bool = False) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # decoding starts here
        self.read = 0  # text of ids[prefix:read] has already been released

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            # The released chunk stays as decoding context for the next one (leading-space rules).
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """What is left (possibly ending in U+FFFD when the stream stopped inside a character)."""
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
