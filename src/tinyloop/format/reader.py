"""Load a `.tinyloop` file's weights into memory the tensors own, keyed by layout name."""

from __future__ import annotations

import os
import sys
import zlib

import torch

from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.checksums import corrupted_tensors
from tinyloop.format.header import ModelHeader, read_header
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
    """Read the file's weights into private memory and return them keyed by layout name.

    The data section is read once, sequentially, into memory the returned tensors own: nothing keeps the
    file open or mapped, so overwriting, truncating or deleting it afterwards cannot change or crash the
    model. Every stored tensor's CRC32 is checked against the header, and every floating-point tensor
    (matrices, vectors, INT8/INT4 scales and minimums) is checked finite; a corrupted tensor or a NaN or
    infinite value is refused with a TinyLoopFormatError naming the tensor.
    """
    if sys.byteorder != "little":
        raise RuntimeError("reading .tinyloop files needs a little-endian machine")
    path = os.fspath(path)
    if header is None:
        header = read_header(path)
    data = _read_tensors(path, header)
    weights: dict[str, Weight] = {}
    for spec in model_specs(header.config):
        tq = header.quantization.tensors[spec.name]
        if spec.role == "vector" or tq.kind == "dense":
            weights[spec.name] = data[spec.name].to(device)
        elif tq.kind == "int8":
            scale = data[f"{spec.name}.scale"]
            weights[spec.name] = Int8Weight(data[f"{spec.name}.q8"], scale).to(device)
        else:
            assert tq.group_size is not None
            scale = data[f"{spec.name}.scale"]
            minimum = data[f"{spec.name}.min"]
            packed = data[f"{spec.name}.q4"]
            if tq.channel is None:
                weights[spec.name] = Int4Weight(packed, scale, minimum, tq.group_size).to(device)
            else:
                # Runs as plain INT4 unless cross-iteration rounding is switched on (runtime/loader.py).
                channel = data[f"{spec.name}.{tq.channel}"]
                w4 = ChanneledInt4Weight(packed, scale, minimum, tq.group_size, channel, tq.channel)
                weights[spec.name] = w4.to(device)
    return header, weights


def verify_checksums(path: str | os.PathLike[str]) -> list[str]:
    """Names of stored tensors whose CRC32 does not match the header (empty when the file is intact)."""
    return corrupted_tensors(read_header(path))


def _read_tensors(path: str, header: ModelHeader) -> dict[str, torch.Tensor]:
    """Every stored tensor in its own fresh memory, read front to back with plain reads (a file that shrank
    since its header was read gives a short read, refused, never a fault on a mapped page). Each tensor's
    CRC32 is checked and each float tensor checked finite as it arrives: a flipped bit or a NaN norm weight
    would otherwise load and silently change every output."""
    out: dict[str, torch.Tensor] = {}
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != header.file_size:
                raise _changed(path, header, size)
            f.seek(header.data_start)
            for name, entry in header.tensors.items():  # file order: back to back from the data start
                dtype = TORCH_DTYPES[entry.dtype]
                t = torch.empty(entry.shape, dtype=dtype)
                if entry.nbytes:
                    view = t.view(-1).view(torch.uint8).numpy().data
                    got = 0
                    while got < entry.nbytes:
                        n = f.readinto(view[got:])
                        if not n:
                            raise _changed(path, header, header.data_start + entry.start + got)
                        got += n
                    crc = f"{zlib.crc32(view) & 0xFFFFFFFF:08x}"
                    if crc != header.checksums[name]:
                        expected = f"data with CRC32 {header.checksums[name]} (metadata 'checksums')"
                        raise TinyLoopFormatError(path, f"tensor {name!r}", expected, f"{crc} (corrupted)")
                    if dtype.is_floating_point and not bool(torch.isfinite(t).all()):
                        raise TinyLoopFormatError(path, f"tensor {name!r}", "finite values", "NaN or infinite values")
                out[name] = t
    except OSError as exc:
        raise TinyLoopFormatError(path, "file", "a readable file", f"{type(exc).__name__}: {exc}") from None
    return out


def _changed(path: str, header: ModelHeader, size: int) -> TinyLoopFormatError:
    expected = f"{header.file_size} bytes (as when the header was read)"
    return TinyLoopFormatError(path, "file size", expected, f"{size} bytes (the file changed)")
