"""The pieces of a transformer layer as plain functions: norms, RoPE, attention with a KV slot (the layer
itself, with its norm placement, is model/looped.py's `layer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from tinyloop.config import ArchConfig
from tinyloop.kernels.dispatch import attention as sdpa
from tinyloop.kernels.dispatch import linear
from tinyloop.model.weights import LayerWeights, Norm


class KVStore(Protocol):
    """What attention needs from a cache: store this step's K/V in a slot, return what to attend to.

    A store with `stores_hidden = True` is called as `update_hidden(slot, x, k, v, ctx, w)` instead
    (x: the layer's normalized input, w: its LayerWeights), to keep x and rebuild K/V from it.
    """

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class StepContext:
    """Per-step inputs shared by every layer and loop iteration of one forward pass.

    positions: [B, T] absolute positions (the same in every loop iteration).
    cos, sin:  [B, T, head_dim/2] float32 RoPE factors for those positions.
    mask:      [B, 1, T, S] bool (True = attend) over the S cache positions returned by the store,
               or None to attend causally over this step's own tokens only.
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    cache: KVStore | None


def position_mask(positions: torch.Tensor, span: int) -> torch.Tensor:
    """Which keys each query sees ([B, 1, T, span] bool): the query at positions[b, t] ([B, T]) sees cache
    positions 0 .. positions[b, t]."""
    keys = torch.arange(span, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)


def norm(x: torch.Tensor, w: Norm, cfg: ArchConfig) -> torch.Tensor:
    xf = x.float()
    if cfg.norm_kind == "rmsnorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        return y.to(x.dtype) * w.weight.to(x.dtype)
    y = F.layer_norm(xf, (xf.shape[-1],), w.weight.float(), None if w.bias is None else w.bias.float(), cfg.norm_eps)
    return y.to(x.dtype)


def rope_tables(cfg: ArchConfig, length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [length, head_dim/2] float32."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / cfg.head_dim))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    """x: [B, T, heads, head_dim]; cos/sin: [B, T, head_dim/2]."""
    xf = x.float()
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if pairing == "half":
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return out.to(x.dtype)


def attend(x: torch.Tensor, w: LayerWeights, cfg: ArchConfig, ctx: StepContext, slot: int) -> torch.Tensor:
    """Attention of the normalized rows x [B, T, d] through cache slot `slot`: the heads' outputs [B, T, q_dim]
    before the output projection."""
    B, T, _ = x.shape
    qkv = linear(x, w.qkv)
    q, k, v = qkv.split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), dim=-1)
    if w.q_bias is not None and w.k_bias is not None:
        q = q + w.q_bias.to(q.dtype)
        k = k + w.k_bias.to(k.dtype)
    q = apply_rope(q.view(B, T, cfg.n_heads, cfg.head_dim), ctx.cos, ctx.sin, cfg.rope_pairing)
    k = apply_rope(k.view(B, T, cfg.n_kv_heads, cfg.head_dim), ctx.cos, ctx.sin, cfg.rope_pairing)
    q = q.transpose(1, 2)  # [B, H, T, hd]
    k = k.transpose(1, 2)  # [B, KVH, T, hd]
    v = v.view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
    gqa = cfg.n_heads != cfg.n_kv_heads
    if ctx.cache is not None and getattr(ctx.cache, "stores_hidden", False):
        k_all, v_all = ctx.cache.update_hidden(slot, x, k, v, ctx, w)  # type: ignore[attr-defined]
    elif ctx.cache is not None:
        k_all, v_all = ctx.cache.update(slot, k, v, ctx)
    else:
        k_all, v_all = k, v
    if ctx.mask is None:
        out = sdpa(q, k_all, v_all, causal=T > 1, gqa=gqa)
    elif q.device.type == "cpu":
        out = masked_attention(q, k_all, v_all, ctx.mask)
    else:
        out = sdpa(q, k_all, v_all, mask=ctx.mask, gqa=gqa)
    return out.transpose(1, 2).reshape(B, T, cfg.q_dim)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention with a boolean mask, as plain matmuls.

    On CPU, SDPA with an explicit mask costs milliseconds even for one query over a few keys; decode
    steps (a few queries over a cached span) are far cheaper this way. q [B, H, T, hd], k/v [B, KVH, S, hd],
    mask [B, 1, T, S]; query head h reads kv head h // (H / KVH).
    """
    B, H, T, hd = q.shape
    kvh, S = k.shape[1], k.shape[2]
    group = H // kvh
    qg = q.reshape(B, kvh, group * T, hd)
    scores = (qg @ k.transpose(-1, -2)).view(B, kvh, group, T, S) * (hd**-0.5)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(B, kvh, group * T, S)
    return (probs @ v).view(B, H, T, hd)
