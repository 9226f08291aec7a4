"""Read and validate a `.tinyloop` file's header without touching tensor data (pure stdlib)."""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, NoReturn

from tinyloop.config import ArchConfig, ConfigError
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.header_json import BoundedJson
from tinyloop.format.header_json import clip as _clip
from tinyloop.format.header_json import is_int as _is_int
from tinyloop.format.header_json import loads as _loads
from tinyloop.format.header_json import show as _show
from tinyloop.format.header_json import type_name as _type_name
from tinyloop.format.spec import (
    BITS,
    DTYPE_SIZES,
    FLOAT_DTYPES,
    FORMAT_NAME,
    GROUP_SIZES,
    KINDS,
    MAX_HEADER_BYTES,
    OPTIONAL_METADATA,
    READ_VERSIONS,
    REQUIRED_METADATA,
    QuantInfo,
    StoredSpec,
    TensorQuant,
    expected_stored,
    is_looped,
    kind_allowed,
    version_str,
)
from tinyloop.format.tokenizer_meta import TokenizerMetaError, parse_tokenizer_meta
from tinyloop.layout import model_specs
from tinyloop.stochastic.channel_kinds import CHANNELS

_VERSION_RE = re.compile(r"(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})")
_CRC_RE = re.compile(r"[0-9a-f]{8}")
_QUANT_KEYS = ("bits", "group_size", "float_dtype", "tensors")
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class TensorEntry:
    """A stored tensor's header entry; offsets are relative to the start of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ModelHeader:
    """Everything the header of a valid `.tinyloop` file says, checked against the file's size."""

    path: str
    config: ArchConfig
    quantization: QuantInfo
    tensors: dict[str, TensorEntry]  # stored name -> entry, in file (offset) order
    checksums: dict[str, str]
    file_size: int
    data_start: int
    format_version: tuple[int, int]
    metadata: dict[str, str] = field(repr=False)

    @property
    def weight_bytes(self) -> int:
        return self.file_size - self.data_start

    @property
    def format_version_str(self) -> str:
        return f"{self.format_version[0]}.{self.format_version[1]}"


def config_crc32(config_text: str) -> str:
    """The `config_crc32` metadata value: CRC32 of the `config` string's UTF-8 bytes, 8 lowercase hex digits."""
    return f"{zlib.crc32(config_text.encode('utf-8')) & 0xFFFFFFFF:08x}"


def read_header(path: str | os.PathLike[str]) -> ModelHeader:
    """Parse and validate the header of a `.tinyloop` file; every problem is one TinyLoopFormatError."""
    return _Parser(os.fspath(path)).parse()


class _Parser(BoundedJson):
    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, what: str, expected: str, found: str) -> NoReturn:
        raise TinyLoopFormatError(self.path, what, expected, found)

    # ---- raw bytes ----------------------------------------------------------------------------
    def parse(self) -> ModelHeader:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(8)
                if len(prefix) < 8:
                    self.fail("file", "at least 8 bytes (header length)", f"{len(prefix)} bytes")
                n = int.from_bytes(prefix, "little")
                if n > MAX_HEADER_BYTES:
                    self.fail("header length", f"at most {MAX_HEADER_BYTES} bytes", f"{n} bytes")
                if n > size - 8:
                    self.fail("header length", f"at most {size - 8} bytes (the file is {size} bytes)", f"{n} bytes")
                raw = f.read(n)
        except OSError as exc:
            self.fail("file", "a readable file", f"{type(exc).__name__}: {exc.strerror or exc}")
        if len(raw) != n:
            self.fail("header", f"{n} bytes", f"{len(raw)} bytes (file changed while reading)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.fail("header", "UTF-8 JSON", f"invalid UTF-8 at byte {8 + exc.start}")
        return self.parse_doc(self.scan(text), size, 8 + n)

    # ---- JSON document ------------------------------------------------------------------------
    def parse_doc(self, doc: dict[str, Any], size: int, data_start: int) -> ModelHeader:
        meta = doc.get("__metadata__")
        if not isinstance(meta, dict):
            found = "no __metadata__" if meta is None else _type_name(meta)
            self.fail("__metadata__", "an object of strings (not a tinyloop file?)", found)
        for key, value in meta.items():
            if not isinstance(value, str):
                self.fail(f"metadata {key!r}", "a string", _type_name(value))
        version = self.check_identity(meta)
        lenient = version[1] > READ_VERSIONS[version[0]]
        missing = [k for k in REQUIRED_METADATA if k not in meta]
        if missing:
            self.fail("metadata", f"keys {list(REQUIRED_METADATA)}", f"missing {missing}")
        known = set(REQUIRED_METADATA) | set(OPTIONAL_METADATA)
        unknown = sorted(k for k in meta if k not in known and not k.startswith("x-"))
        if unknown and not lenient:
            self.fail("metadata", f"only keys {sorted(known)} or 'x-' keys", f"unknown {_show(unknown)}")
        cfg = self.parse_config(meta["config"])
        self.check_config_crc(meta["config"], meta.get("config_crc32"), version)
        entries = self.parse_entries({k: v for k, v in doc.items() if k != "__metadata__"})
        # A hostile config could claim millions of layers; bound it by the tensors actually present
        # before expanding the layout.
        if cfg.n_layers > len(entries):
            self.fail("config", f"at most {len(entries)} layers (one per stored tensor)", f"{cfg.n_layers} layers")
        quant = self.parse_quantization(meta["quantization"], cfg, lenient, version)
        self.check_tokenizer(meta.get("tokenizer"), cfg)
        self.check_tensors(entries, expected_stored(cfg, quant))
        ordered = self.check_offsets(entries, size, data_start)
        checksums = self.parse_checksums(meta["checksums"], entries)
        return ModelHeader(self.path, cfg, quant, ordered, checksums, size, data_start, version, dict(meta))

    def check_identity(self, meta: dict[str, str]) -> tuple[int, int]:
        fmt = meta.get("format")
        if fmt != FORMAT_NAME:
            self.fail("metadata 'format'", repr(FORMAT_NAME), "nothing" if fmt is None else _show(fmt))
        raw = meta.get("format_version")
        if raw is None:
            self.fail("metadata 'format_version'", "'MAJOR.MINOR'", "nothing")
        match = _VERSION_RE.fullmatch(raw)
        if match is None:
            self.fail("metadata 'format_version'", "'MAJOR.MINOR'", _show(raw))
        version = (int(match.group(1)), int(match.group(2)))
        newest = max(READ_VERSIONS)
        if version[0] > newest:
            reads = " and ".join(version_str((m, n)) for m, n in sorted(READ_VERSIONS.items()))
            self.fail(
                "metadata 'format_version'",
                f"major version at most {newest} (this tinyloop reads {reads}; upgrade tinyloop)",
                raw,
            )
        if version[0] not in READ_VERSIONS:
            self.fail("metadata 'format_version'", f"major version {min(READ_VERSIONS)} to {newest}", raw)
        return version

    def check_config_crc(self, text: str, crc: str | None, version: tuple[int, int]) -> None:
        if crc is None:
            if version[1] >= 1:  # written by every 1.1 / 2.1 writer; absent only from 1.0 / 2.0 files
                self.fail("metadata", f"a 'config_crc32' key (format {version_str(version)})", "none")
            return
        if _CRC_RE.fullmatch(crc) is None:
            self.fail("metadata 'config_crc32'", "8 lowercase hex digits", _show(crc))
        if config_crc32(text) != crc:
            self.fail("metadata 'config'", f"a string whose CRC32 is {crc} ('config_crc32')", config_crc32(text))

    def parse_config(self, text: str) -> ArchConfig:
        self.bounded_json("config", text)
        try:
            return ArchConfig.from_json(text)
        except ConfigError as exc:
            if exc.field is not None:
                self.fail(f"metadata 'config' field {exc.field!r}", exc.expected, exc.found)
            self.fail("metadata 'config'", "a valid architecture config", _clip(str(exc), 240))
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            self.fail("metadata 'config'", "a valid architecture config", _clip(str(exc), 240))

    def check_tokenizer(self, text: str | None, cfg: ArchConfig) -> None:
        """An embedded tokenizer needs config tokenizer 'embedded' (ids are not bytes); see tokenizer_meta."""
        if text is None:
            return
        if cfg.tokenizer != "embedded":
            self.fail("metadata 'tokenizer'", "no tokenizer when the config's tokenizer is 'bytes'", "one")
        self.bounded_json("tokenizer", text)
        try:
            parse_tokenizer_meta(text, cfg.vocab_size)
        except TokenizerMetaError as exc:
            self.fail("metadata 'tokenizer'", "a valid embedded tokenizer (docs/format.md 2.3)", _clip(str(exc), 240))

    def parse_entries(self, items: dict[str, Any]) -> dict[str, TensorEntry]:
        entries: dict[str, TensorEntry] = {}
        for name, obj in items.items():
            what = f"tensor {_show(name)}"
            if not isinstance(obj, dict) or sorted(obj) != sorted(_ENTRY_KEYS):
                found = sorted(obj) if isinstance(obj, dict) else _type_name(obj)
                self.fail(what, f"an object with keys {list(_ENTRY_KEYS)}", _show(found))
            dtype, shape, offsets = obj["dtype"], obj["shape"], obj["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
                self.fail(f"{what} dtype", f"one of {sorted(DTYPE_SIZES)}", _show(dtype))
            if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
                self.fail(f"{what} shape", "a list of non-negative integers", _show(shape))
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(_is_int(o) and o >= 0 for o in offsets)
                or offsets[0] > offsets[1]
            ):
                self.fail(f"{what} data_offsets", "[begin, end] with 0 <= begin <= end", _show(offsets))
            entries[name] = TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
        return entries

    def json_object(self, key: str, text: str) -> dict[str, Any]:
        """A metadata value that must be a JSON object."""
        what = f"metadata {key!r}"
        self.bounded_json(key, text)
        try:
            obj = _loads(text)
        except (ValueError, RecursionError) as exc:
            self.fail(what, "a JSON object", f"invalid JSON ({_clip(str(exc))})")
        if not isinstance(obj, dict):
            self.fail(what, "a JSON object", _type_name(obj))
        return obj

    def parse_quantization(self, text: str, cfg: ArchConfig, lenient: bool, version: tuple[int, int]) -> QuantInfo:
        what = "metadata 'quantization'"
        obj = self.json_object("quantization", text)
        missing = [k for k in _QUANT_KEYS if k not in obj]
        extra = sorted(k for k in obj if k not in _QUANT_KEYS)
        if missing or (extra and not lenient):
            self.fail(what, f"keys {list(_QUANT_KEYS)}", f"missing {missing}, unknown {_show(extra)}")
        bits, group_size, float_dtype, tensors = (obj[k] for k in _QUANT_KEYS)
        if not _is_int(bits) or bits not in BITS:
            self.fail(f"{what} bits", f"one of {list(BITS)}", _show(bits))
        if group_size is not None and (not _is_int(group_size) or group_size not in GROUP_SIZES):
            self.fail(f"{what} group_size", f"null or one of {list(GROUP_SIZES)}", _show(group_size))
        if bits == 4 and group_size is None:
            self.fail(f"{what} group_size", f"one of {list(GROUP_SIZES)} when bits is 4", "null")
        if not isinstance(float_dtype, str) or float_dtype not in FLOAT_DTYPES:
            self.fail(f"{what} float_dtype", f"one of {list(FLOAT_DTYPES)}", _show(float_dtype))
        if not isinstance(tensors, dict):
            self.fail(f"{what} tensors", "an object", _type_name(tensors))
        specs = model_specs(cfg)
        names = {s.name for s in specs}
        missing = [s.name for s in specs if s.name not in tensors]
        extra = sorted(n for n in tensors if n not in names)
        if missing or extra:
            self.fail(
                f"{what} tensors", "one entry per model tensor", f"missing {_show(missing)}, extra {_show(extra)}"
            )
        out: dict[str, TensorQuant] = {}
        for spec in specs:
            out[spec.name] = self.parse_tensor_quant(
                tensors[spec.name], spec.name, spec.role, spec.shape, bits, lenient, version[0] >= 2
            )
        return QuantInfo(bits, group_size, float_dtype, out)

    def parse_tensor_quant(
        self, obj: Any, name: str, role: str, shape: tuple[int, ...], bits: int, lenient: bool, channels: bool
    ) -> TensorQuant:
        what = f"metadata 'quantization' tensor {name!r}"
        if not isinstance(obj, dict) or "kind" not in obj or "group_size" not in obj:
            self.fail(what, "an object with keys 'kind' and 'group_size'", _show(obj))
        allowed = ("kind", "group_size", "channel") if channels else ("kind", "group_size")
        if any(k not in allowed for k in obj) and not lenient:
            hint = "" if channels else " (a rounding 'channel' needs format_version 2.0)"
            self.fail(what, f"only keys {list(allowed)}{hint}", _show(sorted(obj)))
        kind, gs = obj["kind"], obj["group_size"]
        channel = obj.get("channel") if channels else None
        if channel is not None:
            if channel not in CHANNELS:
                self.fail(f"{what} channel", f"one of {list(CHANNELS)}", _show(channel))
            if kind != "int4" or role != "linear" or not is_looped(name):
                self.fail(
                    f"{what} channel", "only on int4 looped matrices (body.* and adapter.weight)", f"kind {kind!r}"
                )
        if kind not in KINDS:
            self.fail(f"{what} kind", f"one of {list(KINDS)}", _show(kind))
        if role == "vector" and kind != "dense":
            self.fail(f"{what} kind", "'dense' (norms and biases are never quantized)", _show(kind))
        if not kind_allowed(kind, bits):
            self.fail(f"{what} kind", f"a kind of at least {bits} bits (the file's 'bits')", _show(kind))
        if kind == "int4":
            if not _is_int(gs) or gs not in GROUP_SIZES:
                self.fail(f"{what} group_size", f"one of {list(GROUP_SIZES)}", _show(gs))
            if shape[1] % gs:
                self.fail(f"{what} group_size", f"a divisor of in_features {shape[1]}", _show(gs))
            return TensorQuant("int4", gs, channel)
        if gs is not None:
            self.fail(f"{what} group_size", f"null for kind {kind!r}", _show(gs))
        return TensorQuant(kind)

    def check_tensors(self, entries: dict[str, TensorEntry], expected: dict[str, StoredSpec]) -> None:
        missing = [n for n in expected if n not in entries]
        if missing:
            self.fail("tensors", "every tensor of the layout", f"missing {_show(missing, 200)}")
        extra = sorted(n for n in entries if n not in expected)
        if extra:
            self.fail("tensors", "no tensors outside the layout", f"extra {_show(extra, 200)}")
        for name, spec in expected.items():
            entry = entries[name]
            if entry.dtype != spec.dtype:
                self.fail(f"tensor {name!r} dtype", spec.dtype, entry.dtype)
            if entry.shape != spec.shape:
                self.fail(f"tensor {name!r} shape", str(list(spec.shape)), _show(list(entry.shape)))
            if entry.nbytes != spec.nbytes:
                self.fail(f"tensor {name!r} data_offsets", f"{spec.nbytes} bytes", f"{entry.nbytes} bytes")

    def check_offsets(self, entries: dict[str, TensorEntry], size: int, data_start: int) -> dict[str, TensorEntry]:
        if data_start % 8:
            self.fail("header length", "a data section starting at a multiple of 8 bytes", f"offset {data_start}")
        ordered = sorted(entries.values(), key=lambda e: (e.start, e.end))
        position = 0
        for entry in ordered:
            if entry.start != position:
                found = "an overlap" if entry.start < position else "a gap"
                self.fail(f"tensor {entry.name!r} data_offsets", f"begin {position} (tensors back to back)", found)
            if entry.start % DTYPE_SIZES[entry.dtype]:
                self.fail(
                    f"tensor {entry.name!r} data_offsets", f"a multiple of {DTYPE_SIZES[entry.dtype]}", str(entry.start)
                )
            position = entry.end
        expected_size = data_start + position
        if size < expected_size:
            self.fail("file size", f"{expected_size} bytes", f"{size} bytes (file is truncated)")
        if size > expected_size:
            self.fail("file size", f"{expected_size} bytes", f"{size} bytes ({size - expected_size} trailing bytes)")
        return {e.name: e for e in ordered}

    def parse_checksums(self, text: str, entries: dict[str, TensorEntry]) -> dict[str, str]:
        what = "metadata 'checksums'"
        obj = self.json_object("checksums", text)
        missing = [n for n in entries if n not in obj]
        extra = sorted(n for n in obj if n not in entries)
        if missing or extra:
            self.fail(what, "one checksum per stored tensor", f"missing {_show(missing)}, extra {_show(extra)}")
        for name, value in obj.items():
            if not isinstance(value, str) or _CRC_RE.fullmatch(value) is None:
                self.fail(f"{what} {name!r}", "8 lowercase hex digits", _show(value))
        return {n: obj[n] for n in entries}
