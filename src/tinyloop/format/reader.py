"""Load a `.tinyloop` file's weights as memory-mapped torch tensors, keyed by layout name."""

from __future__ import annotations

import mmap
import os
import sys

import torch

from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.checksums import corrupted_tensors
from tinyloop.format.header import ModelHeader, TensorEntry, read_header
from tinyloop.layout import model_specs
from tinyloop.quant import Int4Weight, Int8Weight
from tinyloop.stochastic.weight import ChanneledInt4Weight

Weight = torch.Tensor | Int8Weight | Int4Weight
TORCH_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
}


def load_weights(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", header: ModelHeader | None = None
) -> tuple[ModelHeader, dict[str, Weight]]:
    """Map the file and return its weights without reading them (pages load on first touch).

    Only INT8/INT4 scales and minimums are read, to refuse NaN or infinite values.
    """
    if sys.byteorder != "little":
        raise RuntimeError("reading .tinyloop files needs a little-endian machine")
    path = os.fspath(path)
    if header is None:
        header = read_header(path)
    mapped = _map(path, header)
    weights: dict[str, Weight] = {}
    for spec in model_specs(header.config):
        tq = header.quantization.tensors[spec.name]
        if spec.role == "vector" or tq.kind == "dense":
            weights[spec.name] = _view(mapped, header, spec.name).to(device)
        elif tq.kind == "int8":
            scale = _finite(mapped, header, f"{spec.name}.scale")
            weights[spec.name] = Int8Weight(_view(mapped, header, f"{spec.name}.q8"), scale).to(device)
        else:
            assert tq.group_size is not None
            scale = _finite(mapped, header, f"{spec.name}.scale")
            minimum = _finite(mapped, header, f"{spec.name}.min")
            packed = _view(mapped, header, f"{spec.name}.q4")
            if tq.channel is None:
                weights[spec.name] = Int4Weight(packed, scale, minimum, tq.group_size).to(device)
            else:
                # Runs as plain INT4 unless cross-iteration rounding is switched on (runtime/loader.py).
                channel = _view(mapped, header, f"{spec.name}.{tq.channel}")
                w4 = ChanneledInt4Weight(packed, scale, minimum, tq.group_size, channel, tq.channel)
                weights[spec.name] = w4.to(device)
    return header, weights


def verify_checksums(path: str | os.PathLike[str]) -> list[str]:
    """Names of stored tensors whose CRC32 does not match the header (empty when the file is intact)."""
    return corrupted_tensors(read_header(path))


def _map(path: str, header: ModelHeader) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # A private copy-on-write map: tensors may be written to in memory, never the file.
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size == header.file_size else None
    except (OSError, ValueError) as exc:
        raise TinyLoopFormatError(
            path, "file", "a file that can be memory-mapped", f"{type(exc).__name__}: {exc}"
        ) from None
    if mapped is None:
        # Touching pages past the end of a shrunken file would crash the process (SIGBUS).
        expected = f"{header.file_size} bytes (as when the header was read)"
        raise TinyLoopFormatError(path, "file size", expected, f"{size} bytes")
    return mapped


def _view(mapped: mmap.mmap, header: ModelHeader, name: str) -> torch.Tensor:
    entry: TensorEntry = header.tensors[name]
    dtype = TORCH_DTYPES[entry.dtype]
    count = entry.nbytes // dtype.itemsize
    if count == 0:
        return torch.empty(entry.shape, dtype=dtype)
    # frombuffer keeps a reference to the map, which stays open as long as any tensor uses it.
    flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=header.data_start + entry.start)
    return flat.view(entry.shape)


def _finite(mapped: mmap.mmap, header: ModelHeader, name: str) -> torch.Tensor:
    t = _view(mapped, header, name)
    if not bool(torch.isfinite(t).all()):
        raise TinyLoopFormatError(header.path, f"tensor {name!r}", "finite values", "NaN or infinite values")
    return t
