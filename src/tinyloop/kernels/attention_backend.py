"""Which SDPA implementation prefill attention uses on CUDA (the policy's `sdpa_math_only`, from
TINYLOOP_DISABLE_FLASH2_PREFILL, and `sdpa_cudnn`, from TINYLOOP_USE_CUDNN_SDPA); CPU always uses PyTorch's
default choice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Flash first (16-bit, no mask), then the memory-efficient kernel (float32, masks), then math.
_NO_PLAN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    gqa: bool = False,
    math_only: bool = False,
    cudnn: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention, q [B, H, T, hd], k/v [B, KVH, S, hd]."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    if not (math_only or cudnn):
        # Left to itself PyTorch picks cuDNN on Hopper, which builds an execution plan for every new shape:
        # milliseconds of host time each, and a continuous batcher's prompt chunks come in ever new shapes.
        with sdpa_kernel(_NO_PLAN_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    if math_only:  # the simple path: one matmul-softmax-matmul, no tiling
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    except RuntimeError:  # cuDNN missing or this shape unsupported: fall back silently, as documented
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
