"""What a one-token step's attention works on besides its qkv rows, as one value for the launchers that take it
(cuda_ops.rope_attention, attention_out.attention_out)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OneTokenAttention:
    k_cache: torch.Tensor  # [B, KVH, S, head_dim], this step's key written at `positions`
    v_cache: torch.Tensor
    positions: torch.Tensor  # [B]
    cos: torch.Tensor  # RoPE tables [S, head_dim / 2]
    sin: torch.Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int
    interleaved: bool  # RoPE pairs adjacent features instead of the two halves
