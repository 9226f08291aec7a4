"""Validation of token-id inputs: 1-D int32 arrays, lists, lossless conversions only."""

from __future__ import annotations

from typing import Any

import numpy as np


def as_token_array(tokens: Any, vocab_size: int, name: str = "tokens", allow_empty: bool = False) -> np.ndarray:
    """Return a 1-D int32 array of ids in [0, vocab_size), or raise ValueError saying what is wrong."""
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, (bytes, bytearray)):
        tokens = np.frombuffer(bytes(tokens), dtype=np.uint8)
    if isinstance(tokens, str):
        raise ValueError(f"{name} must be token ids (np.ndarray[int32] or a list of ints), got a str; encode it first")
    arr = np.asarray(tokens)
    if arr.dtype == object:
        raise ValueError(f"{name} must contain only integers")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        if allow_empty:
            return arr.astype(np.int32)
        raise ValueError(f"{name} must not be empty")
    if arr.dtype == np.bool_:
        raise ValueError(f"{name} must be integers, got booleans")
    if np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} of dtype {arr.dtype} cannot be converted to int32 without loss")
    elif not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    low, high = arr.min(), arr.max()
    if low < 0 or high >= vocab_size:
        bad = int(low) if low < 0 else int(high)
        raise ValueError(f"{name} contains id {bad}, outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int32)
