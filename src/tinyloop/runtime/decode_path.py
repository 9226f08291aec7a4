"""Chooses the specialised decode step for an engine's device (CPU fast path, CUDA graphs) if one applies.

`Engine.step` hands a call to the decoder only when the call is a plain cached decode step: tokens
appended after a dense `KVCache`, no resume, no hidden states asked for. Everything else — and any
call a decoder declines by returning None — runs the generic `forward`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from tinyloop.cache.kv import KVCache
from tinyloop.model.looped import ForwardOutput

if TYPE_CHECKING:
    from tinyloop.runtime.engine import Engine


class Decoder(Protocol):
    def decode(
        self, tokens: torch.Tensor, cache: KVCache, loops: int, valid: torch.Tensor | None, last_only: bool
    ) -> ForwardOutput | None:
        """Append tokens [B, T] after what `cache` holds; None = not handled, use the generic path.

        Must leave `cache.lengths` untouched: the engine updates it.
        """
        ...


def select_decoder(engine: Engine) -> Decoder | None:
    """The decoder for this engine, or None for the generic forward everywhere."""
    return None
