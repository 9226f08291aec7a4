"""Architecture config of a looped transformer: one frozen dataclass, validated once, torch-free."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tinyloop.strict_json import unique_keys_hook

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
    """An architecture config field is missing, of the wrong type, or out of range.

    For a single bad field, `field`, `expected` and `found` name it, the accepted values and the value.
    """

    def __init__(self, message: str, field: str | None = None, expected: str = "", found: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.found = found


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
            data = json.loads(text, object_pairs_hook=_unique_keys)
        # ValueError also covers integers longer than Python's int-string conversion limit.
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ArchConfig:
        return dataclasses.replace(self, **changes)


_unique_keys = unique_keys_hook(ConfigError, "config repeats the key {key!r}")


# What the runtime can honour. A file outside these ranges is refused at load, before anything is
# allocated (docs/format.md, "2.4 Config ranges").
MAX_POSITION = 1 << 20  # RoPE positions; tables are sized by the run's max_seq_len, never by this
MAX_LAYERS = 256  # prelude + body + coda layers stored in one file
MAX_VOCAB = 1 << 24
MAX_WIDTH = 1 << 17  # d_model and ffn_dim
MAX_HEAD_DIM = 1024
MAX_HEADS = 4096
MAX_SEED = (1 << 63) - 1

_INT_RANGES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, MAX_VOCAB),
    "d_model": (1, MAX_WIDTH),
    "n_heads": (1, MAX_HEADS),
    "n_kv_heads": (1, MAX_HEADS),
    "head_dim": (2, MAX_HEAD_DIM),
    "ffn_dim": (1, MAX_WIDTH),
    "n_prelude": (0, MAX_LAYERS),
    "n_body": (1, MAX_LAYERS),
    "n_coda": (0, MAX_LAYERS),
    "default_loops": (1, MAX_LOOPS),
    "max_position": (1, MAX_POSITION),
    "state_init_seed": (0, MAX_SEED),
}
# Closed ranges: [low, high]. Every released looped or RoPE model lies well inside them; values outside
# overflow float32 (scales), swamp the normalised signal (eps) or alias positions within a few hundred
# tokens (rope_base below 100: the slowest rotation's period is 2*pi*base).
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "norm_eps": (1e-12, 1e-2),
    "rope_base": (1e2, 1e10),
    "state_init_std": (0.0, 1e2),
    "embed_scale": (1e-4, 1e4),
    "logit_scale": (1e-4, 1e4),
}
_BOOL_FIELDS = ("qk_bias", "head_norm", "tied_embeddings", "exit_gate")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _bad(name: str, expected: str, found: object) -> ConfigError:
    return ConfigError(f"config field {name!r} must be {expected}, found {found!r}", name, expected, repr(found))


def _validate(cfg: ArchConfig) -> None:
    for name, (low, high) in _INT_RANGES.items():
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _bad(name, "an integer", value)
        if not low <= value <= high:
            raise _bad(name, f"an integer in [{low}, {high}]", value)
    for name, (flow, fhigh) in FLOAT_RANGES.items():
        value = getattr(cfg, name)
        # A huge JSON integer overflows float conversion inside isfinite; treat it as not finite.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise _bad(name, f"a finite number in [{flow:g}, {fhigh:g}]", value)
        if not flow <= value <= fhigh:
            raise _bad(name, f"a number in [{flow:g}, {fhigh:g}]", value)
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(cfg, name), bool):
            raise _bad(name, "true or false", getattr(cfg, name))
    for name, choices in _CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise _bad(name, f"one of {list(choices)}", getattr(cfg, name))
    if not isinstance(cfg.family, str) or not isinstance(cfg.name, str):
        raise ConfigError("config fields 'family' and 'name' must be strings")
    if not isinstance(cfg.extra, dict):
        raise ConfigError(f"config field 'extra' must be an object, found {type(cfg.extra).__name__}")
    if cfg.n_layers > MAX_LAYERS:
        raise ConfigError(f"config has {cfg.n_layers} layers (prelude + body + coda); at most {MAX_LAYERS} are read")
    if cfg.head_dim % 2:
        raise _bad("head_dim", "even (RoPE rotates pairs)", cfg.head_dim)
    if cfg.n_heads % cfg.n_kv_heads:
        raise ConfigError(f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.n_kv_heads})")
    if cfg.state_start == "random" and cfg.state_init_std == 0:
        raise ConfigError("state_start 'random' needs state_init_std > 0")
