"""The canonical tensor names and shapes of a model, derived from its config (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tinyloop.config import ArchConfig

# linear: a matrix used as x @ W.T (quantizable); embedding: a row table (quantizable, read by
# gather and, when tied, as the head); vector: norms, biases and other small float tensors.
TensorRole = Literal["linear", "embedding", "vector"]
Stage = Literal["prelude", "body", "coda"]
STAGES: tuple[Stage, ...] = ("prelude", "body", "coda")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: TensorRole

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def in_body(self) -> bool:
        return self.name.startswith("body.")


def stage_layers(cfg: ArchConfig, stage: Stage) -> int:
    return {"prelude": cfg.n_prelude, "body": cfg.n_body, "coda": cfg.n_coda}[stage]


def _norm(name: str, cfg: ArchConfig) -> list[TensorSpec]:
    specs = [TensorSpec(f"{name}.weight", (cfg.d_model,), "vector")]
    if cfg.norm_kind == "layernorm":
        specs.append(TensorSpec(f"{name}.bias", (cfg.d_model,), "vector"))
    return specs


def layer_specs(cfg: ArchConfig, prefix: str) -> list[TensorSpec]:
    """Tensors of one transformer layer, e.g. prefix 'body.2'."""
    d, f = cfg.d_model, cfg.ffn_dim
    specs = _norm(f"{prefix}.attn_norm", cfg)
    if cfg.is_sandwich:
        specs += _norm(f"{prefix}.attn_post_norm", cfg)
    specs.append(TensorSpec(f"{prefix}.attn.qkv.weight", (cfg.q_dim + 2 * cfg.kv_dim, d), "linear"))
    if cfg.qk_bias:
        specs.append(TensorSpec(f"{prefix}.attn.q_bias", (cfg.q_dim,), "vector"))
        specs.append(TensorSpec(f"{prefix}.attn.k_bias", (cfg.kv_dim,), "vector"))
    specs.append(TensorSpec(f"{prefix}.attn.out.weight", (d, cfg.q_dim), "linear"))
    specs += _norm(f"{prefix}.mlp_norm", cfg)
    if cfg.is_sandwich:
        specs += _norm(f"{prefix}.mlp_post_norm", cfg)
    if cfg.ffn_kind == "swiglu":
        specs.append(TensorSpec(f"{prefix}.mlp.gate_up.weight", (2 * f, d), "linear"))
    else:
        specs.append(TensorSpec(f"{prefix}.mlp.up.weight", (f, d), "linear"))
    specs.append(TensorSpec(f"{prefix}.mlp.down.weight", (d, f), "linear"))
    return specs


def model_specs(cfg: ArchConfig) -> list[TensorSpec]:
    """Every tensor a model file must hold, in file order."""
    d = cfg.d_model
    specs = [TensorSpec("embed.weight", (cfg.vocab_size, d), "embedding")]
    for stage in STAGES:
        for i in range(stage_layers(cfg, stage)):
            specs += layer_specs(cfg, f"{stage}.{i}")
    if cfg.injection == "concat":
        specs.append(TensorSpec("adapter.weight", (d, 2 * d), "linear"))
    if cfg.exit_gate:
        specs.append(TensorSpec("exit_gate.weight", (1, d), "vector"))
        specs.append(TensorSpec("exit_gate.bias", (1,), "vector"))
    if cfg.has_final_norm:
        specs += _norm("final_norm", cfg)
    if not cfg.tied_embeddings:
        specs.append(TensorSpec("head.weight", (cfg.vocab_size, d), "linear"))
    return specs


def parameter_count(cfg: ArchConfig) -> int:
    return sum(s.numel for s in model_specs(cfg))
