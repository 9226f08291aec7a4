"""Rebuild a layer's K and V from the normalized attention input it was computed from (KV "hidden" mode)."""

from __future__ import annotations

import torch

from tinyloop.config import ArchConfig
from tinyloop.kernels.dispatch import linear
from tinyloop.model.layers import apply_rope
from tinyloop.model.weights import LayerWeights


def kv_from_hidden(
    h: torch.Tensor, w: LayerWeights, cfg: ArchConfig, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [B, S, d] at positions 0..S-1 (cos/sin [S, head_dim/2]) -> k, v [B, kv_heads, S, head_dim]."""
    B, S, _ = h.shape
    if isinstance(w.qkv, torch.Tensor):
        kv = linear(h, w.qkv[cfg.q_dim :])  # rows [k; v] only: no query work
    else:
        kv = linear(h, w.qkv)[..., cfg.q_dim :]
    k, v = kv.split((cfg.kv_dim, cfg.kv_dim), dim=-1)
    if w.k_bias is not None:
        k = k + w.k_bias.to(k.dtype)
    c, s = cos[None].expand(B, -1, -1), sin[None].expand(B, -1, -1)
    k = apply_rope(k.reshape(B, S, cfg.n_kv_heads, cfg.head_dim), c, s, cfg.rope_pairing)
    return k.transpose(1, 2), v.reshape(B, S, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
