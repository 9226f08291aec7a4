"""Opaque cache handles (PrefixCache, ResumeHandle): immutable snapshots that own their memory, freed with
their last reference, by close(), or when their model closes."""

from __future__ import annotations

import functools

import numpy as np
import torch

from tinyloop.cache.pool import content_key
from tinyloop.errors import ModelClosedError


class CacheHandle:
    """tokens (read-only int32), loops, nbytes; the K/V snapshot of one KV mode (None in mode 'none')."""

    kind = "cache handle"

    def __init__(
        self,
        model_key: str,
        tokens: np.ndarray,
        loops: int,
        kv: dict[str, torch.Tensor] | None,
        last_logits: torch.Tensor,
    ) -> None:
        self._tokens = np.array(tokens, dtype=np.int32)
        self._tokens.setflags(write=False)
        self._loops = int(loops)
        self._model_key = model_key
        self._kv = kv
        self._last_logits: torch.Tensor | None = last_logits
        self._closed_by: str | None = None

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens

    @property
    def loops(self) -> int:
        return self._loops

    @property
    def model_key(self) -> str:
        return self._model_key

    @property
    def closed(self) -> bool:
        return self._closed_by is not None

    def _tensors(self) -> list[torch.Tensor]:
        out = list((self._kv or {}).values())
        return out + ([self._last_logits] if self._last_logits is not None else [])

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this handle owns (0 once closed)."""
        return sum(t.nbytes for t in self._tensors()) + self._tokens.nbytes

    def close(self) -> None:
        """Free the memory now; later use raises RuntimeError."""
        self._release("handle")

    def _release(self, by: str) -> None:
        if self._closed_by is None:
            self._closed_by = by
            self._kv = None
            self._last_logits = None

    def _check(self) -> None:
        if self._closed_by == "model":
            raise ModelClosedError()
        if self._closed_by is not None:
            raise RuntimeError(f"this {self.kind} was closed")

    def kv(self) -> dict[str, torch.Tensor] | None:
        self._check()
        return self._kv

    def last_logits(self) -> torch.Tensor:
        self._check()
        assert self._last_logits is not None
        return self._last_logits

    def __repr__(self) -> str:
        state = " closed" if self.closed else f" {self.nbytes} bytes"
        return f"{type(self).__name__}({self._tokens.size} tokens, loops={self._loops},{state})"


class PrefixCache(CacheHandle):
    """The K/V of every slot for a prefix at one loop count, plus its last logits: many generations can
    start from it (each copies it into the model's working cache and prefills only its suffix)."""

    kind = "prefix cache"

    @functools.cached_property
    def key(self) -> str:
        """Content address: model identity + loops + token ids."""
        return content_key(self._model_key, self._loops, self._tokens)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        kv = self.kv() or {}
        return {**{f"kv.{k}": t for k, t in kv.items()}, "tokens": torch.from_numpy(self._tokens.copy()),
                "last_logits": self.last_logits()}  # fmt: skip


class ResumeHandle(CacheHandle):
    """A prompt's run at `loops`: the K/V snapshot, its last logits, and the final loop state and prelude
    output of every position, from which a deeper run needs only the missing iterations and the coda."""

    kind = "resume handle"

    def __init__(
        self,
        model_key: str,
        tokens: np.ndarray,
        loops: int,
        kv: dict[str, torch.Tensor] | None,
        last_logits: torch.Tensor,
        loop_state: torch.Tensor,
        prelude_out: torch.Tensor,
    ) -> None:
        super().__init__(model_key, tokens, loops, kv, last_logits)
        self._state: tuple[torch.Tensor, torch.Tensor] | None = (loop_state, prelude_out)

    def _tensors(self) -> list[torch.Tensor]:
        return super()._tensors() + list(self._state or ())

    def _release(self, by: str) -> None:
        super()._release(by)
        self._state = None

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._check()
        assert self._state is not None
        return self._state
