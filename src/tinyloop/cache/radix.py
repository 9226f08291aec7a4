"""A radix tree over token ids: longest-prefix match in time linear in the query, whatever the entry count."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

V = TypeVar("V")
TOKEN_BYTES = 4


def encode(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes: edges compare with one memcmp instead of a Python loop."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def _common_bytes(label: bytes, key: bytes, at: int) -> int:
    """Bytes (a whole number of tokens) that `label` shares with key[at:]."""
    n = min(len(label), len(key) - at) // TOKEN_BYTES
    a = np.frombuffer(label, dtype="<i4", count=n)
    b = np.frombuffer(key, dtype="<i4", count=n, offset=at)
    diff = np.flatnonzero(a != b)
    return int(diff[0] if diff.size else n) * TOKEN_BYTES


class RadixNode(Generic[V]):
    """An edge label (the tokens from the parent) and, when a key ends here, its value."""

    __slots__ = ("label", "children", "value", "parent")

    def __init__(self, label: bytes, parent: RadixNode[V] | None, value: V | None = None) -> None:
        self.label = label
        self.parent = parent
        self.value = value
        self.children: dict[bytes, RadixNode[V]] = {}  # keyed by the child label's first token


@dataclass(frozen=True)
class RadixMatch(Generic[V]):
    """depth: tokens of the query that some stored key shares (the longest such prefix);
    below: a node whose every stored key shares those `depth` tokens (it or a descendant holds a value);
    best / best_depth: the deepest value whose whole key is a prefix of the query (None: none)."""

    depth: int
    below: RadixNode[V] | None
    best: RadixNode[V] | None
    best_depth: int


class RadixTree(Generic[V]):
    """Keys are non-empty token sequences; a non-root node without a value has at least two children."""

    def __init__(self) -> None:
        self.root: RadixNode[V] = RadixNode(b"", None)

    def insert(self, tokens: Sequence[int] | np.ndarray, value: V) -> RadixNode[V]:
        key = encode(tokens)
        if not key:
            raise ValueError("radix tree keys must be non-empty")
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i : i + TOKEN_BYTES])
            if child is None:
                leaf: RadixNode[V] = RadixNode(key[i:], node, value)
                node.children[key[i : i + TOKEN_BYTES]] = leaf
                return leaf
            c = _common_bytes(child.label, key, i)
            if c < len(child.label):  # split the edge where the key leaves it
                mid: RadixNode[V] = RadixNode(child.label[:c], node)
                node.children[child.label[:TOKEN_BYTES]] = mid
                child.label = child.label[c:]
                child.parent = mid
                mid.children[child.label[:TOKEN_BYTES]] = child
                child = mid
            node, i = child, i + c
        if node.value is not None:
            raise KeyError("key already stored")
        node.value = value
        return node

    def remove(self, node: RadixNode[V]) -> None:
        """Drop the value at `node` and merge away nodes that no longer branch."""
        node.value = None
        while node is not self.root and node.value is None:
            parent = node.parent
            assert parent is not None
            if not node.children:
                del parent.children[node.label[:TOKEN_BYTES]]
                node.parent = None
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.label = node.label + child.label
                child.parent = parent
                parent.children[node.label[:TOKEN_BYTES]] = child
                node.parent = None
            break

    def match(self, tokens: Sequence[int] | np.ndarray) -> RadixMatch[V]:
        key = encode(tokens)
        node, i = self.root, 0
        best, best_i = None, 0
        below: RadixNode[V] = node
        while True:
            if node.value is not None:
                best, best_i = node, i
            below = node
            if i == len(key):
                break
            child = node.children.get(key[i : i + TOKEN_BYTES])
            if child is None:
                break
            if key.startswith(child.label, i):
                node, i = child, i + len(child.label)
                continue
            i += _common_bytes(child.label, key, i)
            below = child
            break
        if i == 0:
            return RadixMatch(0, None, None, 0)
        return RadixMatch(i // TOKEN_BYTES, below, best, best_i // TOKEN_BYTES)

    @staticmethod
    def any_value(node: RadixNode[V]) -> RadixNode[V]:
        """A node holding a value at or below `node` (the first branch down: cost bounded by depth)."""
        while node.value is None:
            node = next(iter(node.children.values()))
        return node

    @staticmethod
    def key_of(node: RadixNode[V]) -> list[int]:
        parts = []
        n: RadixNode[V] | None = node
        while n is not None:
            parts.append(n.label)
            n = n.parent
        return np.frombuffer(b"".join(reversed(parts)), dtype="<i4").tolist()

    def nodes(self) -> Iterator[RadixNode[V]]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> list[RadixNode[V]]:
        """Raise AssertionError on a broken invariant; return the nodes holding values."""
        valued = []
        if self.root.value is not None or self.root.label or self.root.parent is not None:
            raise AssertionError("radix root must hold no key, label or parent")
        for node in self.nodes():
            for first, child in node.children.items():
                if child.parent is not node:
                    raise AssertionError("child's parent pointer is wrong")
                if not child.label or len(child.label) % TOKEN_BYTES or child.label[:TOKEN_BYTES] != first:
                    raise AssertionError("child label empty, ragged, or filed under the wrong first token")
            if node is not self.root and node.value is None and len(node.children) < 2:
                raise AssertionError("a valueless inner node must branch (the tree is not compressed)")
            if node.value is not None:
                valued.append(node)
        return valued
