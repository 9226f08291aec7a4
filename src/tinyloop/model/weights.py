"""Typed views of a model's tensors, grouped by layer, built from a flat name -> tensor map."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from tinyloop.config import ArchConfig
from tinyloop.kernels.dispatch import Weight
from tinyloop.layout import STAGES, model_specs, stage_layers


@dataclass(frozen=True)
class Norm:
    weight: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: Norm
    attn_post_norm: Norm | None
    qkv: Weight
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    out: Weight
    mlp_norm: Norm
    mlp_post_norm: Norm | None
    gate_up: Weight | None  # SwiGLU: rows [gate; up]
    up: Weight | None  # GELU
    down: Weight

    def matrices(self) -> tuple[Weight, ...]:
        """The layer's matrices that are present: qkv, out, gate_up or up, down."""
        return tuple(m for m in (self.qkv, self.out, self.gate_up, self.up, self.down) if m is not None)


@dataclass(frozen=True)
class ModelWeights:
    embed: Weight
    prelude: tuple[LayerWeights, ...]
    body: tuple[LayerWeights, ...]
    coda: tuple[LayerWeights, ...]
    adapter: Weight | None
    exit_gate_weight: torch.Tensor | None
    exit_gate_bias: torch.Tensor | None
    final_norm: Norm | None
    head: Weight  # the embedding table itself when tied

    @classmethod
    def from_flat(cls, cfg: ArchConfig, flat: Mapping[str, Weight]) -> ModelWeights:
        expected = {s.name for s in model_specs(cfg)}
        missing = sorted(expected - set(flat))
        extra = sorted(set(flat) - expected)
        if missing or extra:
            raise ValueError(f"weights do not match the config: missing {missing[:8]}, unexpected {extra[:8]}")

        def vec(name: str) -> torch.Tensor:
            t = flat[name]
            assert isinstance(t, torch.Tensor), name
            return t

        def norm(name: str) -> Norm:
            bias = vec(f"{name}.bias") if cfg.norm_kind == "layernorm" else None
            return Norm(vec(f"{name}.weight"), bias)

        def layer(p: str) -> LayerWeights:
            return LayerWeights(
                attn_norm=norm(f"{p}.attn_norm"),
                attn_post_norm=norm(f"{p}.attn_post_norm") if cfg.is_sandwich else None,
                qkv=flat[f"{p}.attn.qkv.weight"],
                q_bias=vec(f"{p}.attn.q_bias") if cfg.qk_bias else None,
                k_bias=vec(f"{p}.attn.k_bias") if cfg.qk_bias else None,
                out=flat[f"{p}.attn.out.weight"],
                mlp_norm=norm(f"{p}.mlp_norm"),
                mlp_post_norm=norm(f"{p}.mlp_post_norm") if cfg.is_sandwich else None,
                gate_up=flat[f"{p}.mlp.gate_up.weight"] if cfg.ffn_kind == "swiglu" else None,
                up=flat[f"{p}.mlp.up.weight"] if cfg.ffn_kind == "gelu" else None,
                down=flat[f"{p}.mlp.down.weight"],
            )

        stages = {s: tuple(layer(f"{s}.{i}") for i in range(stage_layers(cfg, s))) for s in STAGES}
        embed = flat["embed.weight"]
        return cls(
            embed=embed,
            prelude=stages["prelude"],
            body=stages["body"],
            coda=stages["coda"],
            adapter=flat["adapter.weight"] if cfg.injection == "concat" else None,
            exit_gate_weight=vec("exit_gate.weight") if cfg.exit_gate else None,
            exit_gate_bias=vec("exit_gate.bias") if cfg.exit_gate else None,
            final_norm=norm("final_norm") if cfg.has_final_norm else None,
            head=embed if cfg.tied_embeddings else flat["head.weight"],
        )


def iter_tensors(obj: object) -> list[torch.Tensor]:
    """Every distinct tensor reachable from a weights object (for byte counts)."""
    seen: dict[int, torch.Tensor] = {}

    def visit(o: object) -> None:
        if isinstance(o, torch.Tensor):
            seen.setdefault(id(o), o)
        elif isinstance(o, (tuple, list)):
            for item in o:
                visit(item)
        elif hasattr(o, "__dataclass_fields__"):
            for f in fields(o):  # type: ignore[arg-type]
                visit(getattr(o, f.name))

    visit(obj)
    return list(seen.values())


def weight_bytes(weights: ModelWeights) -> int:
    return sum(t.nbytes for t in iter_tensors(weights))
