"""Reading a Hugging Face model folder: config JSONs, tokenizer files, single or sharded safetensors.

Tensors are read one at a time with plain file reads (no mmap, no whole-shard load), so converting a
multi-GB checkpoint holds only the tensors being fused at that moment.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from tinyloop.errors import TinyLoopFormatError
from tinyloop.strict_json import unique_keys as _unique_keys

_ST_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
_ST_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_SHARD_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class TensorLocation:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


@dataclass
class HFFolder:
    """A model folder's parsed JSON files and the location of every tensor (nothing loaded yet)."""

    root: Path
    config: dict[str, Any]
    generation_config: dict[str, Any]
    tokenizer_json: dict[str, Any] | None
    tokenizer_config: dict[str, Any]
    special_tokens_map: dict[str, Any]
    tensors: dict[str, TensorLocation] = field(default_factory=dict)

    def fail(self, what: str, expected: str, found: str) -> TinyLoopFormatError:
        return TinyLoopFormatError(self.root, what, expected, found)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def load(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard into fresh memory (its stored dtype)."""
        loc = self.tensors[name]
        with open(loc.file, "rb") as f:
            f.seek(loc.begin)
            data = bytearray(loc.end - loc.begin)
            if f.readinto(data) != len(data):
                raise self.fail(f"tensor {name!r}", f"{len(data)} bytes in {loc.file.name}", "a truncated shard")
        if not data:
            return torch.empty(loc.shape, dtype=_ST_DTYPES[loc.dtype])
        return torch.frombuffer(data, dtype=_ST_DTYPES[loc.dtype]).reshape(loc.shape)

    @property
    def source_dtypes(self) -> set[str]:
        return {loc.dtype for loc in self.tensors.values()}


def _read_json(path: Path, root: Path, required: bool, strict: bool = True) -> dict[str, Any] | None:
    """strict: repeated keys are refused (tokenizer.json is read as its own library reads it)."""
    if not path.exists():
        if required:
            raise TinyLoopFormatError(root, path.name, "a JSON file in the model folder", "no such file")
        return None
    try:
        hook = _unique_keys if strict else None
        obj = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=hook)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TinyLoopFormatError(root, path.name, "a readable JSON file", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise TinyLoopFormatError(root, path.name, "a JSON object", type(obj).__name__)
    return obj


def _shard_header(path: Path, root: Path) -> dict[str, TensorLocation]:
    """Every tensor's location in one safetensors shard, each entry checked (dtype, shape, offsets inside
    the file and matching the shape), so reading a tensor later can only find the bytes it expects."""
    name = path.name
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8 or n > MAX_SHARD_HEADER_BYTES:
                raise TinyLoopFormatError(root, name, "a safetensors file", f"a bad header length ({size} bytes)")
            doc = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_unique_keys)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        if isinstance(exc, TinyLoopFormatError):
            raise
        raise TinyLoopFormatError(root, name, "a readable safetensors file", str(exc)) from None
    if not isinstance(doc, dict):
        raise TinyLoopFormatError(root, name, "a safetensors header (a JSON object)", type(doc).__name__)
    out: dict[str, TensorLocation] = {}
    data_bytes = size - 8 - n
    for tensor, entry in doc.items():
        if tensor == "__metadata__":
            continue
        what = f"{name} tensor {tensor!r}"
        if not isinstance(entry, dict):
            raise TinyLoopFormatError(root, what, "an object with dtype, shape, data_offsets", type(entry).__name__)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
            raise TinyLoopFormatError(root, what, f"a dtype in {sorted(_ST_DTYPES)}", repr(dtype))
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise TinyLoopFormatError(root, f"{what} shape", "a list of non-negative integers", repr(shape)[:80])
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
            or not offsets[0] <= offsets[1] <= data_bytes
        ):
            expected = f"[begin, end] with 0 <= begin <= end <= {data_bytes} (inside {name})"
            raise TinyLoopFormatError(root, f"{what} data_offsets", expected, repr(offsets)[:80])
        count = _ST_SIZES[dtype]
        for d in shape:
            count *= d
        if offsets[1] - offsets[0] != count:
            raise TinyLoopFormatError(
                root, f"{what} data_offsets", f"{count} bytes ({dtype} {shape})", f"{offsets[1] - offsets[0]} bytes"
            )
        out[tensor] = TensorLocation(path, dtype, tuple(shape), 8 + n + offsets[0], 8 + n + offsets[1])
    return out


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _inside(name: object) -> bool:
    """A shard name from the index that stays inside the folder: relative, no '..' (checked by name, so a
    folder of symlinks, as the Hugging Face cache keeps, still converts)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    parts = PurePosixPath(name).parts
    return not PurePosixPath(name).is_absolute() and ".." not in parts and not os.path.isabs(name)


def read_folder(root: str | os.PathLike[str]) -> HFFolder:
    """Parse a Hugging Face checkpoint folder; every problem is one TinyLoopFormatError naming it."""
    path = Path(root)
    if not path.is_dir():
        raise TinyLoopFormatError(path, "model folder", "a directory", "no such directory")
    config = _read_json(path / "config.json", path, required=True)
    assert config is not None
    folder = HFFolder(
        root=path,
        config=config,
        generation_config=_read_json(path / "generation_config.json", path, False) or {},
        tokenizer_json=_read_json(path / "tokenizer.json", path, False, strict=False),
        tokenizer_config=_read_json(path / "tokenizer_config.json", path, False) or {},
        special_tokens_map=_read_json(path / "special_tokens_map.json", path, False) or {},
    )
    index = _read_json(path / INDEX_FILE, path, False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise folder.fail(INDEX_FILE, "a non-empty 'weight_map' object", repr(type(weight_map).__name__))
        outside = sorted({repr(s)[:80] for s in weight_map.values() if not _inside(s)})
        if outside:
            expected = "shard file names inside the model folder (relative, without '..')"
            raise folder.fail(f"{INDEX_FILE} 'weight_map'", expected, ", ".join(outside[:4]))
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise folder.fail("shards", f"every shard named in {INDEX_FILE}", f"missing {missing}")
        for shard in shards:
            for tensor, loc in _shard_header(path / shard, path).items():
                if tensor in folder.tensors:
                    raise folder.fail(f"tensor {tensor!r}", "one shard holding it", f"{shard} and another")
                folder.tensors[tensor] = loc
        absent = sorted(k for k, s in weight_map.items() if k not in folder.tensors)
        if absent:
            raise folder.fail(INDEX_FILE, "every indexed tensor in its shard", f"absent {absent[:8]}")
    elif (path / SINGLE_FILE).is_file():
        folder.tensors = _shard_header(path / SINGLE_FILE, path)
    else:
        raise folder.fail("weights", f"{SINGLE_FILE} or {INDEX_FILE}", "neither")
    return folder
