"""What a scheduler needs of a prefix pool for one model: the longest cached prefix of a row's prompt, and
offering a prefilled prompt's K/V to the pool."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tinyloop.cache.base import copy_out
from tinyloop.cache.pool import PoolMatch, PrefixPool, content_key
from tinyloop.runtime.decode import Row


class PoolEntry(Protocol):
    """What the scheduler reads from a prefix-pool entry (a tinyloop.PrefixCache)."""

    tokens: np.ndarray

    def kv(self) -> dict[str, torch.Tensor] | None: ...

    def last_logits(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class PrefixHooks:
    """The prefix pool and what the scheduler needs to use it for one model: its cache identity, whether
    a snapshot serves a truncated prefix in this KV mode, and how to wrap a snapshot as a pool entry."""

    pool: PrefixPool
    model_key: str
    usable: Callable[[int, int], bool]
    make_entry: Callable[[np.ndarray, int, dict[str, torch.Tensor], torch.Tensor], Any]

    def longest_prefix(self, row: Row) -> PoolMatch | None:
        """The pool's entry sharing the longest prefix with the row's prompt at its loops (None: a miss)."""
        return self.pool.lookup(row.prompt.numpy(), row.loops, self.model_key, self.usable)

    def offer(self, row: Row, kv: dict[str, torch.Tensor], logits: torch.Tensor) -> None:
        """Register the row's prefilled prompt (its K/V and last logits) unless the pool holds it already or it
        exceeds the pool's whole budget."""
        ids = row.prompt.numpy().astype(np.int32)
        if content_key(self.model_key, row.loops, ids) in self.pool:
            return
        entry = self.make_entry(ids, row.loops, kv, copy_out(logits, "prefix logits"))
        if entry.nbytes <= self.pool.max_bytes:
            self.pool.register(entry)
