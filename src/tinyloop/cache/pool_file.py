"""Prefix pools on disk: one safetensors file, entries in LRU order, JSON metadata naming the model."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT = "tinyloop-prefix-pool"
VERSION = 1


class SavablePool(Protocol):
    """What a prefix pool offers this module (PrefixPool in cache/pool.py, which imports this one)."""

    model_key: str | None
    max_bytes: int
    max_entries: int

    def entries(self) -> list[Any]: ...

    def register(self, item: Any) -> str: ...


PoolT = TypeVar("PoolT", bound=SavablePool)


def save_pool(pool: SavablePool, path: str | os.PathLike[str]) -> None:
    """Entries must offer export_tensors() -> {name: tensor}; written to a temporary file, then renamed."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for i, item in enumerate(pool.entries()):
        exported = item.export_tensors()
        for name, t in exported.items():
            tensors[f"{i}/{name}"] = t.detach().to("cpu").contiguous().clone()
        entries.append({"key": item.key, "loops": int(item.loops), "names": sorted(exported)})
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model_key": pool.model_key,
        "max_bytes": pool.max_bytes,
        "max_entries": pool.max_entries,
        "entries": entries,
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"tinyloop": json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _metadata(path: Path) -> dict[str, Any]:
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("tinyloop")
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise ValueError(f"{path}: not a readable prefix pool file ({exc})") from None
    try:
        meta = json.loads(raw) if raw is not None else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a TinyLoop prefix pool file (no '{FORMAT}' metadata)")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: prefix pool format version {meta.get('version')!r}; this runtime reads {VERSION}")
    return meta


def load_pool(path: str | os.PathLike[str], model: Any, new_pool: Callable[[int, int], PoolT]) -> PoolT:
    """Entries come back as the model's PrefixCache objects, on its device, in their saved LRU order, in the
    pool that new_pool(saved max_bytes, saved max_entries) makes."""
    path = Path(path)
    meta = _metadata(path)
    identity = model.cache_identity
    if meta["model_key"] is not None and meta["model_key"] != identity:
        raise ValueError(
            f"{path}: this prefix pool was saved for model {meta['model_key']}, but the model is {identity} "
            "(other weights, dtype or KV mode); rebuild the pool with this model"
        )
    pool = new_pool(meta["max_bytes"], meta["max_entries"])
    with safe_open(str(path), framework="pt", device=str(model.device)) as f:
        for i, entry in enumerate(meta["entries"]):
            tensors = {name: f.get_tensor(f"{i}/{name}") for name in entry["names"]}
            item = model._prefix_cache_from_tensors(tensors, int(entry["loops"]))
            if item.key != entry["key"]:
                raise ValueError(f"{path}: entry {i} does not match its content key (the file is corrupted)")
            pool.register(item)
    return pool
