"""Launcher of one-token attention fused with the output projection (kernels/triton_attention_out.py): which
steps it takes, its scratch and its grid."""

from __future__ import annotations

import torch
import triton

from tinyloop.kernels.one_token import OneTokenAttention
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.kernels.triton_attention_out import _attention_out_kernel
from tinyloop.quant import BlockedInt4Weight

# (device, rows, heads, tiles, head_dim, rows per tile) -> (heads' outputs, partial products, arrival counts): every
# launch leaves the counts zero, so one set serves every layer of a step and every replay of a captured graph.
_SCRATCH: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def attention_out_applies(
    policy: KernelPolicy, rows: int, attn: OneTokenAttention, out_weight: object, long_cache: bool
) -> bool:
    """Whether the policy fuses this one-token step's attention with its output projection: on for `rows` rows
    (`attention_out_max_rows`), a cache shorter than `long_cache_keys` (each program attends over its head's
    whole cache), and the projection in the blocked INT4 layout with whole blocks per head."""
    if not (isinstance(out_weight, BlockedInt4Weight) and 1 <= rows <= policy.attention_out_max_rows):
        return False
    blocks = attn.head_dim // out_weight.block
    return (
        not long_cache
        and attn.head_dim % out_weight.block == 0
        and blocks & (blocks - 1) == 0
        and out_weight.shape[1] == attn.n_heads * attn.head_dim
    )


def _scratch(device: torch.device, rows: int, n_heads: int, tiles: int, head_dim: int, block_n: int) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]:  # fmt: skip
    key = (device, rows, n_heads, tiles, head_dim, block_n)
    if key not in _SCRATCH:
        _SCRATCH[key] = (
            torch.empty(rows * n_heads * tiles * head_dim, dtype=torch.float32, device=device),
            torch.empty(rows * tiles * n_heads * block_n, dtype=torch.float32, device=device),
            torch.zeros(rows * tiles, dtype=torch.int32, device=device),
        )
    return _SCRATCH[key]


def attention_out(
    policy: KernelPolicy,
    qkv: torch.Tensor,
    attn: OneTokenAttention,
    out_weight: object,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rope_attention` then `out_weight`'s product (+ residual, which is not overwritten) in one launch, where
    `attention_out_applies`: qkv [B, (H + 2 KVH) hd], positions [B] -> [B, d_model]."""
    assert isinstance(out_weight, BlockedInt4Weight)
    rows, n_heads, head_dim, k_cache = qkv.shape[0], attn.n_heads, attn.head_dim, attn.k_cache
    d_model, k_total = out_weight.shape
    keys_per_block, block_n, warps = policy.attention_out_tile
    tiles = triton.cdiv(d_model, block_n)
    out = torch.empty((rows, d_model), dtype=qkv.dtype, device=qkv.device)
    res = residual if residual is not None else out
    heads, part, count = _scratch(qkv.device, rows, n_heads, tiles, head_dim, block_n)
    _attention_out_kernel[(n_heads, tiles, rows)](
        qkv, k_cache, attn.v_cache, attn.positions, attn.cos, attn.sin, out_weight.packed.view(torch.int32),
        out_weight.scale, out_weight.minimum, heads, part, count, out, res, head_dim**-0.5, d_model, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_total // 8, k_total // out_weight.group_size,
        out.stride(0), res.stride(0), N_HEADS=n_heads, N_KV=attn.n_kv_heads, HEAD_DIM=head_dim,
        INTERLEAVED=attn.interleaved, BLOCK_S=keys_per_block, GROUP=out_weight.group_size, BLOCK=out_weight.block,
        BLOCK_N=block_n, HEADS_P2=triton.next_power_of_2(n_heads), RESIDUAL=residual is not None, num_warps=warps,
        **policy.pdl_options(),
    )  # fmt: skip
    return out
