"""PrefixPool: a content-addressed registry of prefix caches with longest-prefix lookup and LRU eviction
under a byte budget. Model-agnostic: it stores anything with tokens, loops, model_key, key and nbytes."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tinyloop.cache.pool_file import load_pool, save_pool
from tinyloop.cache.radix import RadixNode, RadixTree, encode
from tinyloop.errors import ArgumentTypeError


@runtime_checkable
class PoolItem(Protocol):
    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def loops(self) -> int: ...

    @property
    def model_key(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def closed(self) -> bool: ...


def content_key(model_key: str, loops: int, tokens: Sequence[int] | np.ndarray) -> str:
    """The address of a prefix's cache: model identity + loop count + token ids."""
    h = hashlib.sha256(model_key.encode())
    h.update(int(loops).to_bytes(4, "little"))
    h.update(encode(tokens))
    return h.hexdigest()


@dataclass
class _Entry:
    item: Any
    nbytes: int
    node: RadixNode[_Entry] | None = None


@dataclass(frozen=True)
class PoolMatch:
    """item: the registered cache to start from; reuse: how many of the prompt's first tokens it serves
    (its first `reuse` positions: an entry longer than the prompt is truncated); exact: the entry is the
    whole prompt, so its stored last logits give the first token with no compute at all."""

    item: Any
    reuse: int
    exact: bool


class PrefixPool:
    """Registered prefix caches of one model (and KV mode), matched by longest shared prefix.

    Lookups walk a radix tree over token ids (time proportional to the prompt, not to the entry count).
    Registering evicts least-recently-used entries until the new one fits both `max_bytes` and
    `max_entries`; the pool's bytes never exceed `max_bytes`. Not thread-safe.
    """

    def __init__(self, max_bytes: int = 1 << 30, max_entries: int = 4096) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.max_bytes = int(max_bytes)
        self.max_entries = int(max_entries)
        self.clear()

    def clear(self) -> None:
        """Drop every entry (the caches themselves live on while referenced elsewhere) and the counters."""
        self._trees: dict[int, RadixTree[_Entry]] = {}
        self._lru: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self.model_key: str | None = None
        self._counts = dict.fromkeys(("lookups", "hits", "misses", "hit_tokens", "registered", "evictions"), 0)
        self._counts["removed"] = 0

    # ---- registry ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, item: object) -> bool:
        key = item if isinstance(item, str) else getattr(item, "key", None)
        return key in self._lru

    @property
    def nbytes(self) -> int:
        return self._bytes

    def entries(self) -> list[Any]:
        """Registered caches, least recently used first."""
        return [e.item for e in self._lru.values()]

    def register(self, item: PoolItem) -> str:
        """Add a prefix cache (already present: only marks it used); returns its content key."""
        if not isinstance(item, PoolItem):
            raise ArgumentTypeError(
                f"register takes a prefix cache (Model.build_prefix_cache's PrefixCache), got {type(item).__name__}"
            )
        if item.closed:
            raise ValueError("cannot register a closed prefix cache")
        if self.model_key is not None and item.model_key != self.model_key:
            raise ValueError(
                f"this pool holds caches of model {self.model_key}; the cache is of {item.model_key} "
                "(another model, dtype or KV mode); use one pool per model"
            )
        key = item.key
        if key in self._lru:
            self._lru.move_to_end(key)
            return key
        size = int(item.nbytes)
        if size > self.max_bytes:
            raise ValueError(f"a prefix cache of {size} bytes exceeds the pool's max_bytes {self.max_bytes}")
        while self._lru and (self._bytes + size > self.max_bytes or len(self._lru) >= self.max_entries):
            self._drop(next(iter(self._lru)))
            self._counts["evictions"] += 1
        entry = _Entry(item, size)
        tree = self._trees.setdefault(int(item.loops), RadixTree())
        entry.node = tree.insert(item.tokens, entry)
        self._lru[key] = entry
        self._bytes += size
        self.model_key = item.model_key
        self._counts["registered"] += 1
        return key

    def remove(self, item: object) -> bool:
        """Unregister a cache (or a content key); False when it was not registered."""
        key = item if isinstance(item, str) else getattr(item, "key", None)
        if not isinstance(key, str) or key not in self._lru:
            return False
        self._drop(key)
        self._counts["removed"] += 1
        return True

    def prune(self) -> int:
        """Unregister caches that were closed (e.g. by closing their model); returns how many."""
        dead = [k for k, e in self._lru.items() if e.item.closed]
        for key in dead:
            self.remove(key)
        return len(dead)

    def _drop(self, key: str) -> None:
        entry = self._lru.pop(key)
        loops = int(entry.item.loops)
        assert entry.node is not None
        self._trees[loops].remove(entry.node)
        if not self._trees[loops].root.children:
            del self._trees[loops]
        self._bytes -= entry.nbytes
        entry.node = None

    # ---- lookup ------------------------------------------------------------------------------
    def lookup(
        self,
        tokens: Sequence[int] | np.ndarray,
        loops: int,
        model_key: str | None = None,
        usable: Callable[[int, int], bool] | None = None,
    ) -> PoolMatch | None:
        """The registered cache sharing the longest prefix with `tokens` at `loops`, or None (a miss).

        At least the prompt's last token is left to compute unless an entry is exactly the prompt.
        usable(entry_length, reuse) may refuse a truncation (a sliding window cannot always rewind);
        the deepest entry that is a whole prefix of the prompt is then tried instead.
        """
        if model_key is not None and self.model_key is not None and model_key != self.model_key:
            raise ValueError(f"this pool holds caches of model {self.model_key}, not of {model_key}; use one per model")
        self._counts["lookups"] += 1
        found = self._find(tokens, int(loops), usable)
        while found is not None and found.item.closed:  # closed since it was registered: drop, look again
            self.remove(found.item.key)
            found = self._find(tokens, int(loops), usable)
        if found is None:
            self._counts["misses"] += 1
            return None
        self._counts["hits"] += 1
        self._counts["hit_tokens"] += found.reuse
        self._lru.move_to_end(found.item.key)
        return found

    def _find(
        self, tokens: Sequence[int] | np.ndarray, loops: int, usable: Callable[[int, int], bool] | None
    ) -> PoolMatch | None:
        tree = self._trees.get(loops)
        n = len(tokens)
        if tree is None or n == 0:
            return None
        m = tree.match(tokens)
        candidates = []
        if m.below is not None:
            candidates.append((RadixTree.any_value(m.below), m.depth))
        if m.best is not None:
            candidates.append((m.best, m.best_depth))
        for node, shared in candidates:
            entry = node.value
            assert entry is not None
            length = len(entry.item.tokens)
            exact = shared == n and length == n
            reuse = n if exact else min(shared, n - 1)
            if reuse > 0 and (exact or usable is None or usable(length, reuse)):
                return PoolMatch(entry.item, reuse, exact)
        return None

    # ---- accounting --------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """entries, bytes, budgets, and counters: lookups = hits + misses; hit_tokens = prompt tokens
        served from entries; registered - evictions - removed = entries (since the last clear())."""
        return {
            "entries": len(self._lru),
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "max_entries": self.max_entries,
            **self._counts,
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless the trees, the LRU list, the byte count and the counters agree."""
        seen: dict[int, _Entry] = {}
        for loops, tree in self._trees.items():
            if not tree.root.children:
                raise AssertionError(f"empty tree kept for loops={loops}")
            for node in tree.check():
                entry = node.value
                assert entry is not None
                if entry.node is not node or int(entry.item.loops) != loops:
                    raise AssertionError("entry's node pointer or loops disagree with the tree")
                if RadixTree.key_of(node) != np.asarray(entry.item.tokens).tolist():
                    raise AssertionError("entry's tokens differ from its path in the tree")
                seen[id(entry)] = entry
        if set(seen) != {id(e) for e in self._lru.values()}:
            raise AssertionError("the trees and the LRU list hold different entries")
        for key, entry in self._lru.items():
            if key != entry.item.key or entry.item.model_key != self.model_key:
                raise AssertionError("an entry is filed under the wrong content key or model")
        total = sum(e.nbytes for e in self._lru.values())
        if total != self._bytes or total > self.max_bytes or len(self._lru) > self.max_entries:
            raise AssertionError(f"bytes {self._bytes} (sum {total}) or entries {len(self._lru)} over budget")
        c = self._counts
        if c["lookups"] != c["hits"] + c["misses"] or c["registered"] - c["evictions"] - c["removed"] != len(self):
            raise AssertionError(f"counters disagree: {c}, {len(self)} entries")

    # ---- files -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every entry (safetensors + JSON metadata), atomically: a crash leaves the old file."""
        save_pool(self, path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        model: Any,
        max_bytes: int | None = None,
        max_entries: int | None = None,
    ) -> PrefixPool:
        """Read a saved pool for `model` (a tinyloop.Model); a file from another model is refused."""
        return load_pool(
            path, model, lambda saved_bytes, saved_entries: cls(max_bytes or saved_bytes, max_entries or saved_entries)
        )

    def __repr__(self) -> str:
        return f"PrefixPool({len(self)} entries, {self._bytes} of {self.max_bytes} bytes)"
