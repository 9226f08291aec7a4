"""JSON objects that refuse a repeated key (pure stdlib): the one `object_pairs_hook` every reader shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PairsHook = Callable[[list[tuple[str, Any]]], dict[str, Any]]


def unique_keys_hook(error: type[Exception] = ValueError, message: str = "duplicate key {key!r}") -> PairsHook:
    """An `object_pairs_hook` raising `error(message.format(key=...))` at the first repeated key."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise error(message.format(key=key))
            out[key] = value
        return out

    return hook


unique_keys = unique_keys_hook()
