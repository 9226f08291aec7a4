"""The `.tinyloop` file format: header parsing (torch-free), memory-mapped loading and writing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tinyloop.format.checksums import corrupted_tensors
from tinyloop.format.header import ModelHeader, TensorEntry, read_header
from tinyloop.format.spec import CHANNEL_FORMAT_VERSION, FORMAT_VERSION, FORMAT_VERSION_STR, QuantInfo, TensorQuant

if TYPE_CHECKING:
    from tinyloop.format.reader import load_weights, verify_checksums
    from tinyloop.format.writer import write_model, write_quantized

__all__ = [
    "CHANNEL_FORMAT_VERSION",
    "FORMAT_VERSION",
    "FORMAT_VERSION_STR",
    "ModelHeader",
    "QuantInfo",
    "TensorEntry",
    "TensorQuant",
    "corrupted_tensors",
    "load_weights",
    "read_header",
    "verify_checksums",
    "write_model",
    "write_quantized",
]

# The torch-backed half loads on first use, so header-only tools (inspect, verify) never import torch.
_LAZY = {
    "load_weights": "tinyloop.format.reader",
    "verify_checksums": "tinyloop.format.reader",
    "write_model": "tinyloop.format.writer",
    "write_quantized": "tinyloop.format.writer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
