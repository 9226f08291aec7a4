"""The one place every linear layer, embedding lookup and attention of the generic forward goes through.

A backend registers a kernel for (weight kind, device type); anything unregistered falls back to the
reference: dequantize, then a plain matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tinyloop.kernels.attention_backend import sdpa
from tinyloop.quant import CpuInt4Weight, Int4Weight, Int8Weight
from tinyloop.stochastic.weight import StochasticInt4Weight

Weight = torch.Tensor | Int8Weight | Int4Weight
LinearKernel = Callable[[torch.Tensor, Weight], torch.Tensor]
EmbeddingKernel = Callable[[torch.Tensor, Weight, torch.dtype], torch.Tensor]
AttentionKernel = Callable[..., torch.Tensor]

_LINEAR_KERNELS: dict[tuple[str, str], LinearKernel] = {}
_EMBEDDING_KERNELS: dict[tuple[str, str], EmbeddingKernel] = {}
_ATTENTION_KERNELS: dict[str, AttentionKernel] = {}


def weight_kind(w: Weight) -> str:
    if isinstance(w, StochasticInt4Weight):
        return "int4_stoch"  # the fallback's dequantize() draws the iteration's effective weight
    if isinstance(w, CpuInt4Weight):
        return "int4_cpu"  # also in torch's CPU INT4 layout, for bfloat16 compute (kernels/cpu_int4.py)
    if isinstance(w, Int4Weight):
        return "int4"
    if isinstance(w, Int8Weight):
        return "int8"
    return "dense"


def register_linear_kernel(kind: str, device_type: str, kernel: LinearKernel) -> None:
    """Route `linear` for weights of `kind` (a `weight_kind` value) on `device_type` to `kernel`."""
    _LINEAR_KERNELS[(kind, device_type)] = kernel


def register_embedding_kernel(kind: str, device_type: str, kernel: EmbeddingKernel) -> None:
    """Route `embedding` for tables of `kind` on `device_type` to `kernel`."""
    _EMBEDDING_KERNELS[(kind, device_type)] = kernel


def register_attention_kernel(device_type: str, kernel: AttentionKernel) -> None:
    """Route `attention` on `device_type` to `kernel` (`sdpa`'s signature)."""
    _ATTENTION_KERNELS[device_type] = kernel


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x @ w.T for any weight kind."""
    if isinstance(w, torch.Tensor) and not _LINEAR_KERNELS:
        return F.linear(x, w)
    kernel = _LINEAR_KERNELS.get((weight_kind(w), x.device.type))
    if kernel is not None:
        return kernel(x, w)
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return F.linear(x, w.dequantize(x.dtype))


def embedding(ids: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the embedding table for token ids, in `dtype`."""
    kernel = _EMBEDDING_KERNELS.get((weight_kind(w), ids.device.type)) if _EMBEDDING_KERNELS else None
    if kernel is not None:
        return kernel(ids, w, dtype)
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w).to(dtype)
    return w.rows(ids, dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    gqa: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention, q [B, H, T, hd], k/v [B, KVH, S, hd]."""
    kernel = _ATTENTION_KERNELS.get(q.device.type, sdpa)
    return kernel(q, k, v, mask=mask, causal=causal, gqa=gqa)
