"""Cross-iteration stochastic rounding of looped INT4 weights (format 2.0 rounding channels)."""

from __future__ import annotations

from tinyloop.stochastic.pcg import call_key, pcg_hash, pcg_hash_int
from tinyloop.stochastic.weight import ChanneledInt4Weight, CrossIterRound, StochasticInt4Weight

__all__ = [
    "ChanneledInt4Weight",
    "CrossIterRound",
    "StochasticInt4Weight",
    "call_key",
    "pcg_hash",
    "pcg_hash_int",
]
