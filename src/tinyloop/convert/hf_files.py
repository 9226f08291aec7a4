"""Reading a Hugging Face model folder: config JSONs, tokenizer files, single or sharded safetensors.

Tensors are read one at a time with plain file reads (no mmap, no whole-shard load), so converting a
multi-GB checkpoint holds only the tensors being fused at that moment.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinyloop.errors import TinyLoopFormatError

_ST_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


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


def _read_json(path: Path, root: Path, required: bool) -> dict[str, Any] | None:
    if not path.exists():
        if required:
            raise TinyLoopFormatError(root, path.name, "a JSON file in the model folder", "no such file")
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TinyLoopFormatError(root, path.name, "a readable JSON file", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise TinyLoopFormatError(root, path.name, "a JSON object", type(obj).__name__)
    return obj


def _shard_header(path: Path, root: Path) -> dict[str, TensorLocation]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8 or n > 100 * 2**20:
                raise TinyLoopFormatError(root, path.name, "a safetensors file", f"a bad header length ({size} bytes)")
            doc = json.loads(f.read(n).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, TinyLoopFormatError):
            raise
        raise TinyLoopFormatError(root, path.name, "a readable safetensors file", str(exc)) from None
    out: dict[str, TensorLocation] = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            what = f"{path.name} entry {name!r}"
            raise TinyLoopFormatError(root, what, "dtype/shape/data_offsets", "a bad entry") from None
        if dtype not in _ST_DTYPES:
            raise TinyLoopFormatError(root, f"tensor {name!r}", f"a dtype in {sorted(_ST_DTYPES)}", repr(dtype))
        if 8 + n + end > size:
            raise TinyLoopFormatError(root, f"tensor {name!r}", f"data inside {path.name}", "a truncated shard")
        out[name] = TensorLocation(path, dtype, shape, 8 + n + begin, 8 + n + end)
    return out


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
        tokenizer_json=_read_json(path / "tokenizer.json", path, False),
        tokenizer_config=_read_json(path / "tokenizer_config.json", path, False) or {},
        special_tokens_map=_read_json(path / "special_tokens_map.json", path, False) or {},
    )
    index = _read_json(path / INDEX_FILE, path, False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise folder.fail(INDEX_FILE, "a non-empty 'weight_map' object", repr(type(weight_map).__name__))
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise folder.fail("shards", f"every shard named in {INDEX_FILE}", f"missing {missing}")
        for shard in shards:
            folder.tensors.update(_shard_header(path / shard, path))
        absent = sorted(k for k, s in weight_map.items() if k not in folder.tensors)
        if absent:
            raise folder.fail(INDEX_FILE, "every indexed tensor in its shard", f"absent {absent[:8]}")
    elif (path / SINGLE_FILE).is_file():
        folder.tensors = _shard_header(path / SINGLE_FILE, path)
    else:
        raise folder.fail("weights", f"{SINGLE_FILE} or {INDEX_FILE}", "neither")
    return folder
