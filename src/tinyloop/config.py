"""Architecture config of a looped transformer: one frozen dataclass, validated once, torch-free."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

FfnKind = Literal["swiglu", "gelu"]
NormKind = Literal["rmsnorm", "layernorm"]
# pre: x + f(n(x)); sandwich_sum (Huginn): n2(f(n1(x)) + x); sandwich_out (Ouro): x + n2(f(n1(x)))
NormPlacement = Literal["pre", "sandwich_sum", "sandwich_out"]
RopePairing = Literal["half", "interleaved"]
Injection = Literal["none", "add", "concat"]
StateStart = Literal["prelude", "zeros", "random"]
# Where the shared final norm touches the loop state: never, after every iteration (the normed
# state feeds the next iteration, as Ouro), or once when the state leaves the loop (as Huginn).
LoopNorm = Literal["none", "every_loop", "after_loop"]
TokenizerKind = Literal["bytes", "embedded"]

# The most loop iterations one run may ask for: far above any published looped model's depth (Huginn
# tests up to 64, Ouro runs 4), low enough that a scoring call of a few thousand tokens still ends.
MAX_LOOPS = 1024

_CHOICES: dict[str, tuple[str, ...]] = {
    "ffn_kind": ("swiglu", "gelu"),
    "norm_kind": ("rmsnorm", "layernorm"),
    "norm_placement": ("pre", "sandwich_sum", "sandwich_out"),
    "rope_pairing": ("half", "interleaved"),
    "injection": ("none", "add", "concat"),
    "state_start": ("prelude", "zeros", "random"),
    "loop_norm": ("none", "every_loop", "after_loop"),
    "tokenizer": ("bytes", "embedded"),
}


class ConfigError(ValueError):
    """An architecture config field is missing, of the wrong type, or out of range."""


@dataclass(frozen=True)
class ArchConfig:
    """Everything needed to rebuild the model's forward pass from its weights."""

    vocab_size: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    ffn_kind: FfnKind = "swiglu"
    norm_kind: NormKind = "rmsnorm"
    norm_eps: float = 1e-6
    norm_placement: NormPlacement = "pre"
    rope_base: float = 10000.0
    rope_pairing: RopePairing = "half"
    qk_bias: bool = False
    n_prelude: int = 2
    n_body: int = 4
    n_coda: int = 2
    default_loops: int = 8
    injection: Injection = "none"
    state_start: StateStart = "prelude"
    state_init_std: float = 0.0
    state_init_seed: int = 0
    loop_norm: LoopNorm = "none"
    head_norm: bool = True
    embed_scale: float = 1.0
    logit_scale: float = 1.0
    tied_embeddings: bool = True
    exit_gate: bool = False
    max_position: int = 4096
    tokenizer: TokenizerKind = "bytes"
    family: str = "tinyloop"
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived values -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_layers(self) -> int:
        """Physical layers stored in the file (prelude + body + coda)."""
        return self.n_prelude + self.n_body + self.n_coda

    def n_cache_slots(self, loops: int) -> int:
        """KV slots needed at a loop count: one per (iteration, layer)."""
        return self.n_prelude + self.n_coda + loops * self.n_body

    @property
    def has_final_norm(self) -> bool:
        return self.head_norm or self.loop_norm != "none"

    @property
    def is_sandwich(self) -> bool:
        return self.norm_placement != "pre"

    # ---- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> ArchConfig:
        """Build from a mapping; unknown keys and wrong types are errors, never ignored."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, found {type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known fields: {sorted(known)}")
        required = [
            n for n, f in known.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in data]
        if missing:
            raise ConfigError(f"config is missing required field(s) {missing}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> ArchConfig:
        try:
            data = json.loads(text)
        # ValueError also covers integers longer than Python's int-string conversion limit.
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ArchConfig:
        return dataclasses.replace(self, **changes)


_INT_FIELDS = (
    "vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
    "n_prelude", "n_body", "n_coda", "default_loops", "max_position", "state_init_seed",
)  # fmt: skip
_FLOAT_FIELDS = ("norm_eps", "rope_base", "state_init_std", "embed_scale", "logit_scale")
_BOOL_FIELDS = ("qk_bias", "head_norm", "tied_embeddings", "exit_gate")
_LIMIT = 1 << 24


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _validate(cfg: ArchConfig) -> None:
    for name in _INT_FIELDS:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config field {name!r} must be an integer, found {value!r}")
        if not 0 <= value <= _LIMIT:
            raise ConfigError(f"config field {name!r} must be in [0, {_LIMIT}], found {value}")
    for name in (
        "vocab_size",
        "d_model",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "ffn_dim",
        "n_body",
        "default_loops",
        "max_position",
    ):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"config field {name!r} must be at least 1, found {getattr(cfg, name)}")
    for name in _FLOAT_FIELDS:
        value = getattr(cfg, name)
        # A huge JSON integer overflows float conversion inside isfinite; treat it as not finite.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise ConfigError(f"config field {name!r} must be a finite number, found {value!r}")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"config field {name!r} must be true or false, found {getattr(cfg, name)!r}")
    for name, choices in _CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"config field {name!r} must be one of {list(choices)}, found {getattr(cfg, name)!r}")
    if not isinstance(cfg.family, str) or not isinstance(cfg.name, str):
        raise ConfigError("config fields 'family' and 'name' must be strings")
    if not isinstance(cfg.extra, dict):
        raise ConfigError(f"config field 'extra' must be an object, found {type(cfg.extra).__name__}")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim must be even for RoPE, found {cfg.head_dim}")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ConfigError(f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.n_kv_heads})")
    if cfg.norm_eps <= 0 or cfg.rope_base <= 1 or cfg.state_init_std < 0:
        raise ConfigError("norm_eps must be > 0, rope_base > 1 and state_init_std >= 0")
    if cfg.state_start == "random" and cfg.state_init_std == 0:
        raise ConfigError("state_start 'random' needs state_init_std > 0")
