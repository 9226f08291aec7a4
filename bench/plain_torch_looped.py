"""The looped transformer of a `.tinyloop` file written as plain PyTorch, the way a user would write it.

nn.Linear / nn.Embedding modules loaded from the file's dequantized weights, SDPA attention, and a KV cache
that grows with torch.cat (one entry per prelude layer, per body layer per loop, per coda layer). Nothing
from TinyLoop's runtime is used: tinyloop.format only reads the file. It is the baseline of
bench/cpu_decode_vs_plain.py.

Covers the built-in model's architecture and the seed-407m preset's: RMSNorm before each sublayer,
SwiGLU or GELU MLP, RoPE (half pairing), injection none / add / concat, loop state starting from the prelude
output or zeros, tied or separate head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tinyloop.config import ArchConfig
from tinyloop.format.reader import load_weights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, H, T, hd] with cos/sin [T, hd/2] (first half of each head pairs with the second)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass
class KVCache:
    """Past keys and values per cache entry, [B, kv_heads, S, hd], grown by concatenation."""

    entries: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    length: int = 0


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.q_dim, bias=cfg.qk_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.qk_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.q_dim, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None, key: str
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        past = 0
        if cache is not None:
            if key in cache.entries:
                past_k, past_v = cache.entries[key]
                past = past_k.shape[2]
                k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
            cache.entries[key] = (k, v)
        if self.n_kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        if T == 1:  # one new token sees everything before it
            out = F.scaled_dot_product_attention(q, k, v)
        elif past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # several new tokens after a cached prefix
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.swiglu = cfg.ffn_kind == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None, key: str
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, key)
        return x + self.mlp(self.mlp_norm(x))


class PlainLoopedLM(nn.Module):
    """Embedding -> prelude blocks -> body blocks run `loops` times (shared weights) -> coda -> norm -> head."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        unsupported = {
            "norm_kind": cfg.norm_kind != "rmsnorm",
            "norm_placement": cfg.norm_placement != "pre",
            "rope_pairing": cfg.rope_pairing != "half",
            "state_start": cfg.state_start == "random",
            "loop_norm": cfg.loop_norm != "none",
        }
        bad = [name for name, flag in unsupported.items() if flag]
        if bad:
            raise ValueError(f"the plain baseline does not implement these config fields as set: {bad}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude))
        self.body = nn.ModuleList(Block(cfg) for _ in range(cfg.n_body))
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        self.adapter = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False) if cfg.injection == "concat" else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.head_norm else None
        self.lm_head = None if cfg.tied_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        half = cfg.head_dim // 2
        inv_freq = 1.0 / cfg.rope_base ** (torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim)
        angles = torch.arange(cfg.max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, ids: torch.Tensor, loops: int, cache: KVCache | None = None) -> torch.Tensor:
        """Logits [B, T, V] for ids [B, T] placed after what `cache` holds (which then holds them too)."""
        start = cache.length if cache is not None else 0
        T = ids.shape[1]
        cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        x = self.embed(ids) * self.cfg.embed_scale
        for i, block in enumerate(self.prelude):
            x = block(x, cos, sin, cache, f"prelude.{i}")
        prelude_out = x
        state = torch.zeros_like(x) if self.cfg.state_start == "zeros" else prelude_out
        for loop in range(loops):
            if self.adapter is not None:
                state = self.adapter(torch.cat((state, prelude_out), dim=-1))
            elif self.cfg.injection == "add":
                state = state + prelude_out
            for j, block in enumerate(self.body):
                state = block(state, cos, sin, cache, f"loop{loop}.body.{j}")
        x = state
        for i, block in enumerate(self.coda):
            x = block(x, cos, sin, cache, f"coda.{i}")
        if self.norm is not None:
            x = self.norm(x)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if cache is not None:
            cache.length += T
        return F.linear(x, head).float() * self.cfg.logit_scale

    @classmethod
    def from_tinyloop(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> PlainLoopedLM:
        """Build from a `.tinyloop` file: every quantized matrix dequantized to `dtype`."""
        header, flat = load_weights(path)
        cfg = header.config
        dense = {
            name: w.float() if isinstance(w, torch.Tensor) else w.dequantize(torch.float32) for name, w in flat.items()
        }
        model = cls(cfg)
        state: dict[str, torch.Tensor] = {"embed.weight": dense["embed.weight"]}
        for stage in ("prelude", "body", "coda"):
            for i in range(len(getattr(model, stage))):
                p = f"{stage}.{i}"
                qkv = dense[f"{p}.attn.qkv.weight"]
                q, k, v = qkv.split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), dim=0)
                state |= {
                    f"{p}.attn_norm.weight": dense[f"{p}.attn_norm.weight"],
                    f"{p}.attn.q_proj.weight": q,
                    f"{p}.attn.k_proj.weight": k,
                    f"{p}.attn.v_proj.weight": v,
                    f"{p}.attn.o_proj.weight": dense[f"{p}.attn.out.weight"],
                    f"{p}.mlp_norm.weight": dense[f"{p}.mlp_norm.weight"],
                    f"{p}.mlp.down_proj.weight": dense[f"{p}.mlp.down.weight"],
                }
                if cfg.qk_bias:
                    state[f"{p}.attn.q_proj.bias"] = dense[f"{p}.attn.q_bias"]
                    state[f"{p}.attn.k_proj.bias"] = dense[f"{p}.attn.k_bias"]
                if cfg.ffn_kind == "swiglu":
                    gate, up = dense[f"{p}.mlp.gate_up.weight"].chunk(2, dim=0)  # rows [gate; up]
                    state[f"{p}.mlp.gate_proj.weight"], state[f"{p}.mlp.up_proj.weight"] = gate, up
                else:
                    state[f"{p}.mlp.up_proj.weight"] = dense[f"{p}.mlp.up.weight"]
        if cfg.injection == "concat":
            state["adapter.weight"] = dense["adapter.weight"]
        if cfg.head_norm:
            state["norm.weight"] = dense["final_norm.weight"]
        if not cfg.tied_embeddings:
            state["lm_head.weight"] = dense["head.weight"]
        model.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True)
        return model.to(dtype).eval()


@dataclass
class GenerationTiming:
    tokens: list[int]
    prefill_s: float
    decode_s: float  # the len(tokens) - 1 decode steps after the prefill


@torch.inference_mode()
def greedy_generate(model: PlainLoopedLM, prompt: list[int], max_tokens: int, loops: int) -> GenerationTiming:
    """Greedy decoding: the prefill yields the first token, each cached step one more."""
    cache = KVCache()
    t0 = time.perf_counter()
    logits = model(torch.tensor([prompt]), loops, cache)
    token = int(logits[0, -1].argmax())
    t1 = time.perf_counter()
    tokens = [token]
    for _ in range(max_tokens - 1):
        logits = model(torch.tensor([[token]]), loops, cache)
        token = int(logits[0, -1].argmax())
        tokens.append(token)
    return GenerationTiming(tokens, t1 - t0, time.perf_counter() - t1)
