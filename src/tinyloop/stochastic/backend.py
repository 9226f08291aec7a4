"""Picks who computes an effective weight: the Triton kernel on CUDA when triton imports, else torch."""

from __future__ import annotations

import functools

import torch

from tinyloop.stochastic.rounding import dequantize_codes, effective_codes
from tinyloop.stochastic.weight import ChanneledInt4Weight


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def reference_effective_weight(w: ChanneledInt4Weight, key: int, dtype: torch.dtype) -> torch.Tensor:
    codes = effective_codes(w.packed, w.channel, w.channel_kind, key)
    return dequantize_codes(codes, w.scale, w.minimum, w.group_size, dtype)


def effective_weight(w: ChanneledInt4Weight, key: int, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight in `dtype` for one key; both backends give the same bits."""
    if w.packed.is_cuda and triton_available():
        from tinyloop.kernels.triton_stochastic import triton_effective_weight

        return triton_effective_weight(
            w.packed, w.scale, w.minimum, w.channel, w.channel_kind, w.group_size, key, dtype
        )
    return reference_effective_weight(w, key, dtype)
