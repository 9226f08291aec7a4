"""A deliberately naive float64 looped-transformer forward: no cache, explicit loops, written from the
architecture description independently of tinyloop.model. Tests compare every fast path to it."""

from __future__ import annotations

import math

import torch

from tinyloop.config import ArchConfig


def _norm(x, w, b, cfg):
    if cfg.norm_kind == "rmsnorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + cfg.norm_eps) * w + b


def _rope(x, pos, cfg):
    """x: [T, heads, hd] rotated pair by pair."""
    hd = cfg.head_dim
    out = x.clone()
    for p in range(x.shape[0]):
        for i in range(hd // 2):
            theta = pos[p] / (cfg.rope_base ** (2 * i / hd))
            c, s = math.cos(theta), math.sin(theta)
            a, b = (i, i + hd // 2) if cfg.rope_pairing == "half" else (2 * i, 2 * i + 1)
            xa, xb = x[p, :, a], x[p, :, b]
            out[p, :, a] = xa * c - xb * s
            out[p, :, b] = xb * c + xa * s
    return out


def _attention(x, W, p, cfg, pos):
    T = x.shape[0]
    qkv = x @ W[f"{p}.attn.qkv.weight"].T
    q = qkv[:, : cfg.q_dim]
    k = qkv[:, cfg.q_dim : cfg.q_dim + cfg.kv_dim]
    v = qkv[:, cfg.q_dim + cfg.kv_dim :]
    if cfg.qk_bias:
        q = q + W[f"{p}.attn.q_bias"]
        k = k + W[f"{p}.attn.k_bias"]
    q = _rope(q.reshape(T, cfg.n_heads, cfg.head_dim), pos, cfg)
    k = _rope(k.reshape(T, cfg.n_kv_heads, cfg.head_dim), pos, cfg)
    v = v.reshape(T, cfg.n_kv_heads, cfg.head_dim)
    group = cfg.n_heads // cfg.n_kv_heads
    out = torch.zeros(T, cfg.n_heads, cfg.head_dim, dtype=torch.float64)
    for h in range(cfg.n_heads):
        kh = h // group
        for t in range(T):
            scores = (k[: t + 1, kh] @ q[t, h]) / math.sqrt(cfg.head_dim)
            probs = torch.softmax(scores, dim=0)
            out[t, h] = probs @ v[: t + 1, kh]
    return out.reshape(T, cfg.q_dim) @ W[f"{p}.attn.out.weight"].T


def _mlp(x, W, p, cfg):
    if cfg.ffn_kind == "swiglu":
        gu = x @ W[f"{p}.mlp.gate_up.weight"].T
        gate, up = gu[:, : cfg.ffn_dim], gu[:, cfg.ffn_dim :]
        h = gate / (1 + torch.exp(-gate)) * up
    else:
        u = x @ W[f"{p}.mlp.up.weight"].T
        h = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
    return h @ W[f"{p}.mlp.down.weight"].T


def _n(W, name, cfg):
    return W[f"{name}.weight"], W.get(f"{name}.bias")


def _layer(x, W, p, cfg, pos):
    a = _attention(_norm(x, *_n(W, f"{p}.attn_norm", cfg), cfg), W, p, cfg, pos)
    if cfg.norm_placement == "pre":
        x = x + a
    elif cfg.norm_placement == "sandwich_out":
        x = x + _norm(a, *_n(W, f"{p}.attn_post_norm", cfg), cfg)
    else:
        x = _norm(x + a, *_n(W, f"{p}.attn_post_norm", cfg), cfg)
    m = _mlp(_norm(x, *_n(W, f"{p}.mlp_norm", cfg), cfg), W, p, cfg)
    if cfg.norm_placement == "pre":
        return x + m
    if cfg.norm_placement == "sandwich_out":
        return x + _norm(m, *_n(W, f"{p}.mlp_post_norm", cfg), cfg)
    return _norm(x + m, *_n(W, f"{p}.mlp_post_norm", cfg), cfg)


def naive_forward(cfg: ArchConfig, weights: dict, tokens: list[int], loops: int, noise=None):
    """Returns (logits [T, V], states [2 + loops] of [T, d], gate logits [loops] of [T]) in float64."""
    W = {k: v.to(torch.float64) for k, v in weights.items()}
    pos = list(range(len(tokens)))
    e = W["embed.weight"][torch.tensor(tokens)] * cfg.embed_scale
    states = [e]
    x = e
    for i in range(cfg.n_prelude):
        x = _layer(x, W, f"prelude.{i}", cfg, pos)
    prelude_out = x
    states.append(x)
    if cfg.state_start == "prelude":
        s = prelude_out
    elif cfg.state_start == "zeros":
        s = torch.zeros_like(prelude_out)
    else:
        s = noise[: len(tokens)].to(torch.float64)
    gates = []
    fn = _n(W, "final_norm", cfg) if cfg.has_final_norm else None
    for _ in range(loops):
        if cfg.injection == "add":
            s = s + prelude_out
        elif cfg.injection == "concat":
            s = torch.cat([s, prelude_out], dim=-1) @ W["adapter.weight"].T
        for j in range(cfg.n_body):
            s = _layer(s, W, f"body.{j}", cfg, pos)
        if cfg.loop_norm == "every_loop":
            s = _norm(s, *fn, cfg)
        states.append(s)
        if cfg.exit_gate:
            gates.append((s @ W["exit_gate.weight"].T + W["exit_gate.bias"]).squeeze(-1))
    x = s
    if cfg.loop_norm == "after_loop":
        x = _norm(x, *fn, cfg)
    for i in range(cfg.n_coda):
        x = _layer(x, W, f"coda.{i}", cfg, pos)
    if cfg.head_norm:
        x = _norm(x, *fn, cfg)
    head = W["embed.weight"] if cfg.tied_embeddings else W["head.weight"]
    return x @ head.T * cfg.logit_scale, states, gates
