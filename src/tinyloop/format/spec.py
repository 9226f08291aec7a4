"""The `.tinyloop` format's constants, quantization plan and stored-tensor naming (pure stdlib)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tinyloop.config import ArchConfig
from tinyloop.layout import TensorSpec, model_specs
from tinyloop.stochastic.channel_kinds import Channel

FORMAT_NAME = "tinyloop"
# Files without rounding channels are written as 1.1, so every reader of 1.x keeps reading them (1.1 adds
# the optional `config_crc32` key, which a 1.0 reader skips as a newer minor version's key).
FORMAT_VERSION = (1, 1)
FORMAT_VERSION_STR = f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}"
# Rounding channels need 2.x: a 1.x reader refuses it with "upgrade tinyloop" (docs/format.md 12).
CHANNEL_FORMAT_VERSION = (2, 1)
# The newest minor version this reader knows, per major version it reads.
READ_VERSIONS = {1: 1, 2: 1}
MAX_HEADER_BYTES = 64 * 1024 * 1024
# What the largest readable model needs (config.MAX_LAYERS layers of at most 26 stored tensors each, plus
# embedding, head, norms and gate): a hostile header is refused after this many entries, not parsed in full.
MAX_TENSORS = 8192
MAX_METADATA_KEYS = 256
MAX_ENTRY_CHARS = 4096  # one tensor entry's JSON value: dtype, a shape, two offsets
# Per JSON document held in a metadata string: (characters, objects + arrays). Counting brackets is a
# linear scan, so a document that would take seconds to parse is refused before parsing.
METADATA_JSON_LIMITS = {
    "config": (1 << 20, 4096),
    "quantization": (8 << 20, MAX_TENSORS + 16),
    "checksums": (4 << 20, 16),
    "tokenizer": (MAX_HEADER_BYTES, 1 << 21),
}
# The writer starts every tensor whose byte size is a multiple of this at a multiple of it.
DATA_ALIGNMENT = 64
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
FLOAT_DTYPES = ("F32", "F16", "BF16")
BITS = (4, 8, 16)
GROUP_SIZES = (32, 64, 128)
REQUIRED_METADATA = ("format", "format_version", "config", "quantization", "checksums")
OPTIONAL_METADATA = ("tokenizer", "config_crc32")
VECTOR_DTYPE = "F32"
SCALE_DTYPE = "F16"

Kind = Literal["dense", "int8", "int4"]
KINDS: tuple[Kind, ...] = ("dense", "int8", "int4")
# The lowest precision each `bits` value allows; a tensor may always be stored more precisely.
_KIND_BITS = {"dense": 16, "int8": 8, "int4": 4}


@dataclass(frozen=True)
class TensorQuant:
    """How one logical tensor is stored."""

    kind: Kind
    group_size: int | None = None
    channel: Channel | None = None  # a rounding channel (int4 looped matrices of a 2.0 file only)


@dataclass(frozen=True)
class QuantInfo:
    """The file's `quantization` metadata: the requested precision and each tensor's storage kind."""

    bits: int
    group_size: int | None
    float_dtype: str
    tensors: dict[str, TensorQuant]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = dict.fromkeys(KINDS, 0)
        for tq in self.tensors.values():
            out[tq.kind] += 1
        return out

    @property
    def has_channels(self) -> bool:
        return any(tq.channel is not None for tq in self.tensors.values())

    @property
    def format_version(self) -> tuple[int, int]:
        """The version a file with this quantization is written as."""
        return CHANNEL_FORMAT_VERSION if self.has_channels else FORMAT_VERSION

    def to_json_obj(self) -> dict[str, object]:
        tensors: dict[str, dict[str, object]] = {}
        for n, t in self.tensors.items():
            entry: dict[str, object] = {"kind": t.kind, "group_size": t.group_size}
            if t.channel is not None:
                entry["channel"] = t.channel
            tensors[n] = entry
        return {"bits": self.bits, "group_size": self.group_size, "float_dtype": self.float_dtype, "tensors": tensors}


@dataclass(frozen=True)
class StoredSpec:
    """One tensor as it lies in the file: its stored name, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for s in self.shape:
            n *= s
        return n


def is_looped(name: str) -> bool:
    """Matrices applied once per loop iteration: the body's and the injection adapter."""
    return name.startswith("body.") or name == "adapter.weight"


def version_str(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def kind_allowed(kind: Kind, bits: int) -> bool:
    return _KIND_BITS[kind] >= bits


def normalize_float_dtype(name: str) -> str:
    upper = name.upper()
    if upper not in FLOAT_DTYPES:
        raise ValueError(f"float dtype must be one of {list(FLOAT_DTYPES)}, got {name!r}")
    return upper


def plan_quantization(cfg: ArchConfig, bits: int, group_size: int | None, float_dtype: str) -> QuantInfo:
    """Each tensor's storage kind for a requested bit width (INT4 falls back to INT8 when groups don't fit)."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {list(BITS)}, got {bits!r}")
    float_dtype = normalize_float_dtype(float_dtype)
    if bits == 4:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"INT4 group size must be one of {list(GROUP_SIZES)}, got {group_size!r}")
    else:
        group_size = None
    tensors: dict[str, TensorQuant] = {}
    for spec in model_specs(cfg):
        if spec.role == "vector" or bits == 16:
            tensors[spec.name] = TensorQuant("dense")
        elif bits == 8 or group_size is None or spec.shape[1] % group_size:
            tensors[spec.name] = TensorQuant("int8")
        else:
            tensors[spec.name] = TensorQuant("int4", group_size)
    return QuantInfo(bits, group_size, float_dtype, tensors)


def stored_specs(spec: TensorSpec, tq: TensorQuant, float_dtype: str) -> list[StoredSpec]:
    """The stored tensors that hold one logical tensor."""
    if spec.role == "vector":
        return [StoredSpec(spec.name, VECTOR_DTYPE, spec.shape)]
    if tq.kind == "dense":
        return [StoredSpec(spec.name, float_dtype, spec.shape)]
    out_f, in_f = spec.shape
    if tq.kind == "int8":
        return [
            StoredSpec(f"{spec.name}.q8", "I8", (out_f, in_f)),
            StoredSpec(f"{spec.name}.scale", SCALE_DTYPE, (out_f,)),
        ]
    assert tq.group_size is not None
    groups = in_f // tq.group_size
    out = [
        StoredSpec(f"{spec.name}.q4", "U8", (out_f, in_f // 2)),
        StoredSpec(f"{spec.name}.scale", SCALE_DTYPE, (out_f, groups)),
        StoredSpec(f"{spec.name}.min", SCALE_DTYPE, (out_f, groups)),
    ]
    if tq.channel == "sign":
        out.append(StoredSpec(f"{spec.name}.sign", "U8", (out_f, in_f // 8)))
    elif tq.channel == "frac4":
        out.append(StoredSpec(f"{spec.name}.frac4", "U8", (out_f, in_f // 2)))
    return out


def expected_stored(cfg: ArchConfig, quant: QuantInfo) -> dict[str, StoredSpec]:
    """Every stored tensor a file with this config and quantization must hold, in logical order."""
    out: dict[str, StoredSpec] = {}
    for spec in model_specs(cfg):
        for s in stored_specs(spec, quant.tensors[spec.name], quant.float_dtype):
            out[s.name] = s
    return out


def alignment_class(nbytes: int) -> int:
    """The largest power of two (at most DATA_ALIGNMENT) dividing a tensor's byte size."""
    if nbytes == 0:
        return DATA_ALIGNMENT
    return min(DATA_ALIGNMENT, nbytes & -nbytes)


def file_order(stored: list[StoredSpec]) -> list[StoredSpec]:
    """Storage order: by alignment class, largest first, so every tensor starts at a multiple of its class.

    safetensors refuses gaps between tensors, so alignment comes from this ordering alone.
    """
    return sorted(stored, key=lambda s: -alignment_class(s.nbytes))  # sorted() is stable
