"""Ouro and Huginn checkpoints in their Hugging Face layout: config mapping and tensor recipes.

Decisions (docs/FAMILIES.md): q/k rows are kept as stored and the config's rope_pairing says how pairs are
rotated (Ouro: rotate_half = "half"; Huginn: complex/interleaved = "interleaved"), so no permutation is
needed and the conversion is exact. Huginn's lm_head must equal wte (it is tied on load); if it differs
the conversion is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tinyloop.config import ArchConfig, ConfigError
from tinyloop.convert.hf_files import HFFolder
from tinyloop.errors import TinyLoopFormatError

Op = Literal["take", "cat", "row0", "row1"]


@dataclass(frozen=True)
class Recipe:
    """How one canonical tensor is built: `op` over HF tensors, each with its expected shape."""

    op: Op
    parts: tuple[tuple[str, tuple[int, ...]], ...]

    def build(self, folder: HFFolder) -> torch.Tensor:
        if self.op == "cat":
            return torch.cat([folder.load(n) for n, _ in self.parts], dim=0)
        t = folder.load(self.parts[0][0])
        if self.op == "row0":
            return t[0].reshape(-1).clone()
        if self.op == "row1":
            return t[1].reshape(-1).clone()
        return t


@dataclass
class FamilyPlan:
    family: str
    cfg: ArchConfig
    recipes: dict[str, Recipe]
    ignored: set[str] = field(default_factory=set)  # HF tensors that are read only by checks, or not at all
    checks: list[Callable[[HFFolder], None]] = field(default_factory=list)
    stop_tokens: tuple[tuple[str, int], ...] = ()  # (token text, id in the released tokenizer)
    chat_template: str = "none"
    add_bos: bool = False


def _get(folder: HFFolder, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = folder.config.get(key, default)
    if value is None or isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise folder.fail(f"config.json field {key!r}", f"a {getattr(kind, '__name__', kind)}", repr(value))
    return value


def _count(folder: HFFolder, key: str, default: Any = None) -> int:
    """A size (width, head count, layer count) that must be a positive integer."""
    value = _get(folder, key, int, default)
    if value < 1:
        raise folder.fail(f"config.json field {key!r}", "a positive integer", repr(value))
    return int(value)


def _number(folder: HFFolder, key: str, source: dict[str, Any], default: float) -> float:
    """A finite float from `source` (config.json or an object inside it)."""
    value = source.get(key, default)
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number):
        raise folder.fail(f"config.json field {key!r}", "a finite number", repr(value)[:80])
    return number


def _require(folder: HFFolder, key: str, allowed: tuple[Any, ...], default: Any = None) -> None:
    value = folder.config.get(key, default)
    if value not in allowed:
        raise folder.fail(
            f"config.json field {key!r}", f"one of {list(allowed)} (what TinyLoop implements)", repr(value)
        )


def _build_config(folder: HFFolder, **fields: Any) -> ArchConfig:
    try:
        return ArchConfig(**fields)
    except (ConfigError, TypeError) as exc:
        raise folder.fail("config.json", "a config TinyLoop can run", str(exc)) from None


def _layer_recipes(
    prefix: str, hf: str, cfg: ArchConfig, names: dict[str, str], fused_qkv: bool, fused_mlp: bool
) -> dict[str, Recipe]:
    d, q, kv, f = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.ffn_dim
    out = {
        f"{prefix}.attn_norm.weight": Recipe("take", ((f"{hf}.{names['attn_norm']}", (d,)),)),
        f"{prefix}.attn_post_norm.weight": Recipe("take", ((f"{hf}.{names['attn_post_norm']}", (d,)),)),
        f"{prefix}.mlp_norm.weight": Recipe("take", ((f"{hf}.{names['mlp_norm']}", (d,)),)),
        f"{prefix}.mlp_post_norm.weight": Recipe("take", ((f"{hf}.{names['mlp_post_norm']}", (d,)),)),
        f"{prefix}.attn.out.weight": Recipe("take", ((f"{hf}.{names['out']}", (d, q)),)),
        f"{prefix}.mlp.down.weight": Recipe("take", ((f"{hf}.{names['down']}", (d, f)),)),
    }
    if fused_qkv:
        out[f"{prefix}.attn.qkv.weight"] = Recipe("take", ((f"{hf}.{names['qkv']}", (q + 2 * kv, d)),))
    else:
        parts = ((f"{hf}.{names['q']}", (q, d)), (f"{hf}.{names['k']}", (kv, d)), (f"{hf}.{names['v']}", (kv, d)))
        out[f"{prefix}.attn.qkv.weight"] = Recipe("cat", parts)
    if fused_mlp:
        out[f"{prefix}.mlp.gate_up.weight"] = Recipe("take", ((f"{hf}.{names['gate_up']}", (2 * f, d)),))
    else:
        gate_up = ((f"{hf}.{names['gate']}", (f, d)), (f"{hf}.{names['up']}", (f, d)))
        out[f"{prefix}.mlp.gate_up.weight"] = Recipe("cat", gate_up)
    if cfg.qk_bias:
        shape = (2, 1, cfg.n_heads, cfg.head_dim)
        out[f"{prefix}.attn.q_bias"] = Recipe("row0", ((f"{hf}.{names['qk_bias']}", shape),))
        out[f"{prefix}.attn.k_bias"] = Recipe("row1", ((f"{hf}.{names['qk_bias']}", shape),))
    return out


# ---- Ouro (model_type "ouro") -------------------------------------------------------------------
_OURO_NAMES = {
    "attn_norm": "input_layernorm.weight", "attn_post_norm": "input_layernorm_2.weight",
    "mlp_norm": "post_attention_layernorm.weight", "mlp_post_norm": "post_attention_layernorm_2.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "out": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}  # fmt: skip


def ouro_plan(folder: HFFolder, name: str) -> FamilyPlan:
    _require(folder, "hidden_act", ("silu",), "silu")
    _require(folder, "rope_scaling", (None,))
    _require(folder, "use_sliding_window", (False, None))
    d = _count(folder, "hidden_size")
    heads = _count(folder, "num_attention_heads")
    tied = folder.config.get("tie_word_embeddings", False) is True
    cfg = _build_config(
        folder,
        vocab_size=_get(folder, "vocab_size", int),
        d_model=d,
        n_heads=heads,
        n_kv_heads=_get(folder, "num_key_value_heads", int, heads),
        head_dim=_get(folder, "head_dim", int, d // heads if heads else 0),
        ffn_dim=_get(folder, "intermediate_size", int),
        norm_eps=_number(folder, "rms_norm_eps", folder.config, 1e-6),
        norm_placement="sandwich_out",
        rope_base=_number(folder, "rope_theta", folder.config, 10000.0),
        rope_pairing="half",
        n_prelude=0,
        n_body=_get(folder, "num_hidden_layers", int),
        n_coda=0,
        default_loops=_get(folder, "total_ut_steps", int, 4),
        injection="none",
        state_start="prelude",
        loop_norm="every_loop",
        head_norm=False,
        tied_embeddings=tied,
        exit_gate=True,
        max_position=_get(folder, "max_position_embeddings", int, 4096),
        tokenizer="embedded",
        family="ouro",
        name=name,
        extra={"early_exit_threshold": folder.config.get("early_exit_threshold", 1.0), "hf_model_type": "ouro"},
    )
    recipes: dict[str, Recipe] = {"embed.weight": Recipe("take", (("model.embed_tokens.weight", (cfg.vocab_size, d)),))}
    for i in range(cfg.n_body):
        recipes.update(_layer_recipes(f"body.{i}", f"model.layers.{i}", cfg, _OURO_NAMES, False, False))
    recipes["exit_gate.weight"] = Recipe("take", (("model.early_exit_gate.weight", (1, d)),))
    recipes["exit_gate.bias"] = Recipe("take", (("model.early_exit_gate.bias", (1,)),))
    recipes["final_norm.weight"] = Recipe("take", (("model.norm.weight", (d,)),))
    if not tied:
        recipes["head.weight"] = Recipe("take", (("lm_head.weight", (cfg.vocab_size, d)),))
    ignored = {n for n in folder.tensors if n.endswith("rotary_emb.inv_freq")}
    if tied:
        ignored.add("lm_head.weight")
    return FamilyPlan(
        "ouro", cfg, recipes, ignored, [],
        stop_tokens=(("<|im_end|>", 2), ("<|endoftext|>", 0)), chat_template="chatml", add_bos=False,
    )  # fmt: skip


# ---- Huginn (model_type "huginn_raven") ----------------------------------------------------------
_HUGINN_NAMES = {
    "attn_norm": "norm_1.weight", "attn_post_norm": "norm_2.weight", "mlp_norm": "norm_3.weight",
    "mlp_post_norm": "norm_4.weight", "qkv": "attn.Wqkv.weight", "qk_bias": "attn.qk_bias",
    "out": "attn.proj.weight", "gate_up": "mlp.fc.weight", "down": "mlp.proj.weight",
}  # fmt: skip


def huginn_plan(folder: HFFolder, name: str) -> FamilyPlan:
    _require(folder, "injection_type", ("linear",))
    _require(folder, "bias", (False,), False)
    _require(folder, "state_init", ("like-init", "zero"), "like-init")
    _require(folder, "norm_class_name", ("RMSNorm_llama",), "RMSNorm_llama")
    _require(folder, "mlp_class_name", ("GatedMLP",), "GatedMLP")
    _require(folder, "nonlin_name", ("SiLU",), "SiLU")
    _require(folder, "block_class_name", ("SandwichBlock",), "SandwichBlock")
    _require(folder, "test_time_noise", (0, 0.0, None))
    d = _count(folder, "n_embd")
    heads = _count(folder, "n_heads")
    vocab = _get(folder, "padded_vocab_size", int, folder.config.get("vocab_size"))
    init = folder.config.get("init_values") or {}
    if not isinstance(init, dict):
        raise folder.fail("config.json field 'init_values'", "an object", repr(init)[:80])
    std = _number(folder, "std", init, math.sqrt(2 / (5 * d)))
    zero_state = folder.config.get("state_init") == "zero"
    cfg = _build_config(
        folder,
        vocab_size=vocab,
        d_model=d,
        n_heads=heads,
        n_kv_heads=_get(folder, "num_key_value_heads", int, heads),
        head_dim=_get(folder, "head_dim", int, d // heads if heads else 0),
        ffn_dim=_get(folder, "intermediate_size", int),
        norm_eps=_number(folder, "norm_eps", folder.config, 1e-6),
        norm_placement="sandwich_sum",
        rope_base=_number(folder, "rope_base", folder.config, 50000.0),
        rope_pairing="interleaved",
        qk_bias=folder.config.get("qk_bias", True) is True,
        n_prelude=_get(folder, "n_layers_in_prelude", int),
        n_body=_get(folder, "n_layers_in_recurrent_block", int),
        n_coda=_get(folder, "n_layers_in_coda", int),
        default_loops=_get(folder, "mean_recurrence", int, 32),
        injection="concat",
        # Reference: s0 = trunc_normal(0, std, ±3 std) * sqrt(d) = trunc_normal(0, std*sqrt(d), ±3 std*sqrt(d)).
        state_start="zeros" if zero_state else "random",
        state_init_std=0.0 if zero_state else std * math.sqrt(d),
        state_init_seed=0,
        loop_norm="after_loop",
        head_norm=True,
        embed_scale=_number(folder, "embed_scale", init, math.sqrt(d)),
        tied_embeddings=True,
        max_position=_get(folder, "block_size", int, 4096),
        tokenizer="embedded",
        family="huginn",
        name=name,
        extra={"hf_model_type": "huginn_raven"},
    )
    recipes: dict[str, Recipe] = {"embed.weight": Recipe("take", (("transformer.wte.weight", (vocab, d)),))}
    for stage, hf_stage, n in (
        ("prelude", "prelude", cfg.n_prelude),
        ("body", "core_block", cfg.n_body),
        ("coda", "coda", cfg.n_coda),
    ):
        for i in range(n):
            recipes.update(
                _layer_recipes(f"{stage}.{i}", f"transformer.{hf_stage}.{i}", cfg, _HUGINN_NAMES, True, True)
            )
    recipes["adapter.weight"] = Recipe("take", (("transformer.adapter.weight", (d, 2 * d)),))
    recipes["final_norm.weight"] = Recipe("take", (("transformer.ln_f.weight", (d,)),))
    return FamilyPlan(
        "huginn", cfg, recipes, {"lm_head.weight", "freqs_cis"}, [_check_tied_head, _check_freqs_cis(cfg)],
        stop_tokens=(("<|begin_text|>", 65504), ("<|end_text|>", 65505), ("<|end_turn|>", 65508)),
        chat_template="huginn", add_bos=True,
    )  # fmt: skip


def _check_tied_head(folder: HFFolder) -> None:
    """The released shards store lm_head as a second copy of wte; the model ties them on load."""
    if "lm_head.weight" not in folder.tensors:
        return
    if folder.shape("lm_head.weight") != folder.shape("transformer.wte.weight"):
        raise folder.fail("tensor 'lm_head.weight'", "the shape of transformer.wte.weight (tied)", "another shape")
    if not torch.equal(folder.load("lm_head.weight"), folder.load("transformer.wte.weight")):
        raise folder.fail(
            "tensor 'lm_head.weight'",
            "a copy of transformer.wte.weight (Huginn ties them; the stored head would be ignored)",
            "different values; refusing to guess which one the model means",
        )


def _check_freqs_cis(cfg: ArchConfig) -> Callable[[HFFolder], None]:
    """A stored RoPE table must agree with the one rebuilt from rope_base and head_dim."""

    def check(folder: HFFolder) -> None:
        if "freqs_cis" not in folder.tensors:
            return
        table = folder.load("freqs_cis").float()
        half = cfg.head_dim // 2
        if table.dim() != 5 or table.shape[-2:] != (half, 2) or min(table.shape[:3]) < 1:
            raise folder.fail("tensor 'freqs_cis'", f"shape [1, N, 1, {half}, 2]", str(list(table.shape)))
        n = min(int(table.shape[1]), 64)
        inv = 1.0 / (cfg.rope_base ** (torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim))
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
        err = float((table[0, :n, 0, :, 0].double() - ang.cos()).abs().max())
        err = max(err, float((table[0, :n, 0, :, 1].double() - ang.sin()).abs().max()))
        if err > 1e-3:
            raise folder.fail("tensor 'freqs_cis'", "the RoPE table of rope_base and head_dim", f"max error {err:.3g}")

    return check


FAMILIES: dict[str, Callable[[HFFolder, str], FamilyPlan]] = {
    "ouro": ouro_plan,
    "huginn_raven": huginn_plan,
}


def plan_for(folder: HFFolder, name: str) -> FamilyPlan:
    model_type = folder.config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise TinyLoopFormatError(
            folder.root, "config.json field 'model_type'", f"one of {sorted(FAMILIES)}", repr(model_type)
        )
    return FAMILIES[model_type](folder, name)
