"""CRC32 checks of a `.tinyloop` file's stored tensors, read in chunks (pure stdlib)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.header import ModelHeader

CHUNK_BYTES = 8 * 1024 * 1024


def crc32_hex(data: bytes | bytearray | memoryview, value: int = 0) -> str:
    return f"{zlib.crc32(data, value) & 0xFFFFFFFF:08x}"


def corrupted_tensors(header: ModelHeader, progress: Callable[[int], None] | None = None) -> list[str]:
    """Stored tensor names whose CRC32 differs from the header's checksum, in file order."""
    bad: list[str] = []
    try:
        with open(header.path, "rb") as f:
            f.seek(header.data_start)
            for entry in header.tensors.values():
                crc = 0
                left = entry.nbytes
                while left:
                    chunk = f.read(min(left, CHUNK_BYTES))
                    if not chunk:
                        raise TinyLoopFormatError(
                            header.path, "file size", f"{header.file_size} bytes", "a shorter file"
                        )
                    crc = zlib.crc32(chunk, crc)
                    left -= len(chunk)
                    if progress is not None:
                        progress(len(chunk))
                if f"{crc & 0xFFFFFFFF:08x}" != header.checksums[entry.name]:
                    bad.append(entry.name)
    except OSError as exc:
        raise TinyLoopFormatError(header.path, "file", "a readable file", f"{type(exc).__name__}: {exc}") from None
    return bad
