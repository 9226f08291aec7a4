"""Prefix pools on disk: one safetensors file, entries in LRU order, JSON metadata naming the model and
holding a CRC32 per tensor. Loading checks every entry against the model (docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tinyloop.config import MAX_LOOPS
from tinyloop.errors import PrefixPoolFormatError
from tinyloop.format.atomic import atomic_output
from tinyloop.strict_json import unique_keys as _unique_keys

FORMAT = "tinyloop-prefix-pool"
# 2 adds a CRC32 per tensor (verified at load); 1 (no checksums) is still read.
VERSION = 2
READ_VERSIONS = (1, 2)


class SavablePool(Protocol):
    """What a prefix pool offers this module (PrefixPool in cache/pool.py, which imports this one)."""

    model_key: str | None
    max_bytes: int
    max_entries: int

    def entries(self) -> list[Any]: ...

    def register(self, item: Any) -> str: ...


PoolT = TypeVar("PoolT", bound=SavablePool)


def save_pool(pool: SavablePool, path: str | os.PathLike[str]) -> None:
    """Entries must offer export_tensors() -> {name: tensor}. Each tensor's CRC32 goes into the metadata;
    the file is written under a temporary name and renamed (format/atomic.py): a crash or SIGTERM leaves
    the old file. A missing directory raises FileNotFoundError naming it."""
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for i, item in enumerate(pool.entries()):
        exported = item.export_tensors()
        crcs = {}
        for name, t in exported.items():
            cpu = t.detach().to("cpu").contiguous().clone()
            tensors[f"{i}/{name}"] = cpu
            crcs[name] = _crc32(cpu)
        entries.append({"key": item.key, "loops": int(item.loops), "names": sorted(exported), "crc32": crcs})
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model_key": pool.model_key,
        "max_bytes": pool.max_bytes,
        "max_entries": pool.max_entries,
        "entries": entries,
    }
    with atomic_output(path) as tmp:
        save_file(tensors, str(tmp), metadata={"tinyloop": json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())


def _crc32(t: torch.Tensor) -> str:
    data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


class _Reader:
    """Every problem with a pool file is one PrefixPoolFormatError naming the entry and field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, what: str, expected: str, found: object) -> NoReturn:
        raise PrefixPoolFormatError(self.path, what, expected, _show(found))

    def metadata(self) -> dict[str, Any]:
        try:
            with safe_open(str(self.path), framework="pt") as f:
                raw = (f.metadata() or {}).get("tinyloop")
                names = set(f.keys())
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            self.fail("file", "a readable prefix pool file (safetensors)", f"{type(exc).__name__}: {exc}")
        if raw is None:
            self.fail("metadata", f"a 'tinyloop' key of format {FORMAT!r} (not a prefix pool file?)", "none")
        try:
            meta = json.loads(raw, object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError) as exc:
            self.fail("metadata", "a JSON object", f"invalid JSON ({exc})")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            self.fail("metadata 'format'", repr(FORMAT), meta.get("format") if isinstance(meta, dict) else meta)
        if meta.get("version") not in READ_VERSIONS:
            self.fail("metadata 'version'", f"one of {list(READ_VERSIONS)} (this runtime's)", meta.get("version"))
        for key in ("max_bytes", "max_entries"):
            value = meta.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 2**62:
                self.fail(f"metadata {key!r}", "a positive integer", value)
        entries = meta.get("entries")
        if not isinstance(entries, list) or len(entries) > meta["max_entries"]:
            self.fail("metadata 'entries'", f"a list of at most max_entries ({meta['max_entries']}) entries", entries)
        model_key = meta.get("model_key")
        if entries and not isinstance(model_key, str):
            self.fail("metadata 'model_key'", "the model identity the entries were saved for", model_key)
        expected_names = set()
        for i, entry in enumerate(entries):
            self.check_entry(i, entry, meta["version"])
            expected_names |= {f"{i}/{n}" for n in entry["names"]}
        if expected_names != names:
            extra, missing = sorted(names - expected_names), sorted(expected_names - names)
            self.fail("tensors", "exactly the tensors the entries name", f"missing {missing}, extra {extra}")
        return meta

    def check_entry(self, i: int, entry: Any, version: int) -> None:
        what = f"entry {i}"
        if not isinstance(entry, dict):
            self.fail(what, "an object", entry)
        key, loops, names = entry.get("key"), entry.get("loops"), entry.get("names")
        if not isinstance(key, str) or re.fullmatch(r"[0-9a-f]{64}", key) is None:
            self.fail(f"{what} 'key'", "a 64-hex-digit content key", key)
        if not isinstance(loops, int) or isinstance(loops, bool) or not 1 <= loops <= MAX_LOOPS:
            self.fail(f"{what} 'loops'", f"an integer in [1, {MAX_LOOPS}]", loops)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            self.fail(f"{what} 'names'", "a list of distinct tensor names", names)
        if version >= 2:
            crcs = entry.get("crc32")
            if not isinstance(crcs, dict) or set(crcs) != set(names):
                self.fail(f"{what} 'crc32'", "one checksum per tensor the entry names", crcs)
            for name, crc in crcs.items():
                if not isinstance(crc, str) or re.fullmatch(r"[0-9a-f]{8}", crc) is None:
                    self.fail(f"{what} 'crc32' {name!r}", "8 lowercase hex digits", crc)

    def tensors(self, f: Any, i: int, entry: dict[str, Any], model: Any) -> dict[str, torch.Tensor]:
        """An entry's tensors, checked against their checksums and against what the model exports."""
        what = f"entry {i}"
        out: dict[str, torch.Tensor] = {}
        for name in entry["names"]:
            try:
                t = f.get_tensor(f"{i}/{name}")
            except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
                self.fail(f"{what} tensor {name!r}", "a readable tensor", f"{type(exc).__name__}: {exc}")
            crc = entry.get("crc32", {}).get(name)
            if crc is not None and _crc32(t.contiguous()) != crc:
                self.fail(f"{what} tensor {name!r}", f"data with CRC32 {crc}", f"{_crc32(t.contiguous())} (corrupted)")
            out[name] = t
        tokens = out.get("tokens")
        if tokens is None or tokens.dim() != 1 or not 1 <= tokens.numel() <= model.header.config.max_position:
            found = None if tokens is None else list(tokens.shape)
            self.fail(f"{what} tensor 'tokens'", f"1 to {model.header.config.max_position} token ids", found)
        spec = model._prefix_tensor_spec(int(tokens.numel()), int(entry["loops"]))
        if set(out) != set(spec):
            self.fail(f"{what} tensors", f"{sorted(spec)} (this model's KV mode)", sorted(out))
        for name, (shape, dtype) in spec.items():
            t = out[name]
            want = (torch.float32, torch.bfloat16, torch.float16) if name == "last_logits" else (dtype,)
            if t.dtype not in want:
                self.fail(f"{what} tensor {name!r} dtype", " or ".join(map(str, want)), t.dtype)
            if tuple(t.shape) != shape:
                self.fail(f"{what} tensor {name!r} shape", str(list(shape)), list(t.shape))
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                self.fail(f"{what} tensor {name!r}", "finite values", "NaN or infinite values")
        return out


def load_pool(path: str | os.PathLike[str], model: Any, new_pool: Callable[[int, int], PoolT]) -> PoolT:
    """Entries come back as the model's PrefixCache objects, on its device, in their saved LRU order, in the
    pool that new_pool(saved max_bytes, saved max_entries) makes. Every problem with the file is one
    PrefixPoolFormatError naming the entry and field."""
    path = Path(path)
    reader = _Reader(path)
    meta = reader.metadata()
    identity = model.cache_identity
    if meta["entries"] and meta["model_key"] != identity:
        reader.fail(
            "metadata 'model_key'",
            f"this model's identity {identity} (the pool was saved for other weights, dtype or KV mode; "
            "rebuild it with this model)",
            meta["model_key"],
        )
    pool = new_pool(meta["max_bytes"], meta["max_entries"])
    try:
        with safe_open(str(path), framework="pt") as f:
            for i, entry in enumerate(meta["entries"]):
                tensors = {n: t.to(model.device) for n, t in reader.tensors(f, i, entry, model).items()}
                try:
                    item = model._prefix_cache_from_tensors(tensors, int(entry["loops"]))
                except (ValueError, TypeError) as exc:
                    reader.fail(f"entry {i}", "a prefix cache of this model", f"{type(exc).__name__}: {exc}")
                if item.key != entry["key"]:
                    reader.fail(f"entry {i} 'key'", f"{item.key} (the content key of its model, loops and tokens)",
                                entry["key"])  # fmt: skip
                try:
                    pool.register(item)
                except ValueError as exc:
                    reader.fail(f"entry {i}", "an entry the pool can hold", str(exc))
    except (OSError, SafetensorError) as exc:
        reader.fail("file", "a readable prefix pool file", f"{type(exc).__name__}: {exc}")
    return pool


def _show(value: object, limit: int = 120) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
