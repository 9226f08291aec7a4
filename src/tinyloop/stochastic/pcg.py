"""The counter-based PCG hash that draws every rounding decision: one 32-bit word per (key, counter)."""

from __future__ import annotations

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
# PCG-RXS-M-XS on 32 bits: an LCG step, then a random xorshift, a multiply and a fixed xorshift. Every
# step is a bijection of 32-bit words, so distinct counters under one key never collide.
PCG_MULTIPLIER = 747796405
PCG_INCREMENT = 2891336453
PCG_OUTPUT_MULTIPLIER = 277803737
# A rounding decision reads the hash's top bits: probabilities are multiples of 1/32.
RANDOM_BITS = 5


def pcg_hash_int(v: int) -> int:
    """The hash of one 32-bit word, with Python integers."""
    state = (v * PCG_MULTIPLIER + PCG_INCREMENT) & MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * PCG_OUTPUT_MULTIPLIER) & MASK32
    return (word >> 22) ^ word


def pcg_hash(v: torch.Tensor) -> torch.Tensor:
    """The hash of every element of an int64 tensor holding 32-bit words (int64 keeps products exact)."""
    state = (v * PCG_MULTIPLIER + PCG_INCREMENT) & MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * PCG_OUTPUT_MULTIPLIER) & MASK32
    return (word >> 22) ^ word


def pcg_hash_np(v: np.ndarray) -> np.ndarray:
    """The hash of a uint32 array: the same words as pcg_hash, about 5x faster on CPU (uint32 wraps)."""
    assert v.dtype == np.uint32
    state = v * np.uint32(PCG_MULTIPLIER) + np.uint32(PCG_INCREMENT)
    word = ((state >> ((state >> np.uint32(28)) + np.uint32(4))) ^ state) * np.uint32(PCG_OUTPUT_MULTIPLIER)
    return (word >> np.uint32(22)) ^ word


def call_key(seed: int, iteration: int, call: int) -> int:
    """The 32-bit key of one matrix (`call`: its layout index) at one loop iteration under a seed."""
    for v in (iteration, call):
        if not 0 <= v <= MASK32:
            raise ValueError(f"iteration and call must be 32-bit unsigned integers, got {v}")
    k = pcg_hash_int(seed & MASK32)
    k = pcg_hash_int((k + iteration) & MASK32)
    return pcg_hash_int((k + call) & MASK32)
