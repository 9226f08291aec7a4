"""Convert a PyTorch or safetensors checkpoint that uses TinyLoop's canonical names to `.tinyloop`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from tinyloop.config import ArchConfig, ConfigError
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.header import ModelHeader
from tinyloop.format.writer import check_tensor_dict, write_model

_NESTING_KEYS = ("model", "state_dict")
_PREFIXES = ("_orig_mod.", "module.")


def load_config(path: str | os.PathLike[str]) -> ArchConfig:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TinyLoopFormatError(path, "config file", "a readable UTF-8 JSON file", str(exc)) from None
    try:
        return ArchConfig.from_json(text)
    except (ConfigError, TypeError) as exc:
        raise TinyLoopFormatError(path, "config", "a valid architecture config", str(exc)) from None


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict from a .safetensors or torch.save file (loaded with weights_only)."""
    path = os.fspath(path)
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            raw: Any = load_file(path)
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors and torch.load raise many unrelated types on bad input
        raise TinyLoopFormatError(path, "checkpoint", "a loadable checkpoint", f"{type(exc).__name__}: {exc}") from None
    for _ in range(3):
        inner = next(
            (raw[k] for k in _NESTING_KEYS if isinstance(raw, Mapping) and isinstance(raw.get(k), Mapping)), None
        )
        if inner is None:
            break
        raw = inner
    if not isinstance(raw, Mapping):
        raise TinyLoopFormatError(path, "checkpoint", "a mapping of tensor names to tensors", type(raw).__name__)
    out: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        name = str(key)
        stripped = True
        while stripped:
            stripped = False
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name, stripped = name[len(prefix) :], True
        if not isinstance(value, torch.Tensor):
            raise TinyLoopFormatError(path, f"checkpoint entry {key!r}", "a tensor", type(value).__name__)
        if name in out:
            raise TinyLoopFormatError(
                path, f"checkpoint entry {key!r}", "unique names after prefix stripping", f"a second {name!r}"
            )
        out[name] = value
    return out


def convert_checkpoint(
    checkpoint: str | os.PathLike[str],
    config: str | os.PathLike[str] | ArchConfig,
    out: str | os.PathLike[str],
    bits: int = 16,
    group_size: int | None = 64,
    float_dtype: str = "F16",
    progress: bool = True,
) -> ModelHeader:
    cfg = config if isinstance(config, ArchConfig) else load_config(config)
    tensors = load_checkpoint(checkpoint)
    problems = check_tensor_dict(cfg, tensors)
    if problems:
        raise TinyLoopFormatError(checkpoint, "tensors", "exactly the config's layout", "; ".join(problems))
    return write_model(out, cfg, tensors, bits, group_size, float_dtype, progress)
