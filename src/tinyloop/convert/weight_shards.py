"""Training weight files: canonical tensors as fp16 safetensors, one file or numbered shards plus an index."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tinyloop.config import ArchConfig
from tinyloop.format.atomic import atomic_output
from tinyloop.layout import model_specs

WEIGHTS_STEM = "weights_fp16"
# Only files up to 16 MiB come back from the GPU machine; stay under with a margin.
MAX_SHARD_BYTES = 15 * 2**20


def save_weight_shards(out_dir: Path, cfg: ArchConfig, tensors: Mapping[str, torch.Tensor]) -> list[Path]:
    """fp16 safetensors of the canonical tensors: one file when it fits MAX_SHARD_BYTES, else numbered
    shards plus `weights_fp16.index.json`. Stale shards from an earlier save are removed."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in (s.name for s in model_specs(cfg)):
        t = tensors[name].detach().to("cpu", torch.float16).contiguous()
        if shards[-1] and size + t.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if len(shards) == 1:
        names = [f"{WEIGHTS_STEM}.safetensors"]
    else:
        names = [f"{WEIGHTS_STEM}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    meta = {"config": cfg.to_json(), "format": "tinyloop-train-weights"}
    paths = []
    for name, shard in zip(names, shards, strict=True):
        path = out_dir / name
        with atomic_output(path) as tmp:
            save_file(shard, str(tmp), metadata=meta)
        paths.append(path)
    index = out_dir / f"{WEIGHTS_STEM}.index.json"
    if len(shards) > 1:
        index.write_text(json.dumps({"config": cfg.to_dict(), "shards": names}, indent=1) + "\n")
    elif index.exists():
        index.unlink()
    for old in out_dir.glob(f"{WEIGHTS_STEM}*.safetensors"):
        if old.name not in names:
            old.unlink()
    return paths


def _shard_files(path: Path) -> list[Path]:
    if path.is_dir():
        index = path / f"{WEIGHTS_STEM}.index.json"
        single = path / f"{WEIGHTS_STEM}.safetensors"
        if index.exists():
            path = index
        elif single.exists():
            return [single]
        else:
            raise FileNotFoundError(f"no {WEIGHTS_STEM}.safetensors or {index.name} in {path}")
    if path.suffix == ".json":
        names = json.loads(path.read_text())["shards"]
        return [path.parent / n for n in names]
    sibling_index = path.parent / f"{WEIGHTS_STEM}.index.json"
    if "-of-" in path.name and sibling_index.exists():
        return _shard_files(sibling_index)
    return [path]


def load_weight_shards(path: str | os.PathLike[str]) -> tuple[ArchConfig | None, dict[str, torch.Tensor]]:
    """Float32 tensors from a weights file, one of its shards, its index JSON, or the directory holding them."""
    cfg: ArchConfig | None = None
    out: dict[str, torch.Tensor] = {}
    for file in _shard_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            if "config" in meta:
                cfg = ArchConfig.from_json(meta["config"])
            for name in f.keys():
                out[name] = f.get_tensor(name).to(torch.float32)
    return cfg, out
