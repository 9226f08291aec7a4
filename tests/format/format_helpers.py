"""Header surgery for the format tests: split a file, edit its JSON, and join it again."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    """The parsed header and the data section of a file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(path: Path, doc: dict[str, Any], data: bytes, align: int = 64) -> None:
    header = json.dumps(doc).encode()
    header += b" " * (-(8 + len(header)) % align)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def edit_header(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    doc, data = split(path)
    fn(doc)
    join(path, doc, data)


def edit_meta_json(path: Path, key: str, fn: Callable[[Any], object]) -> None:
    """Mutate a JSON-encoded metadata value (config, quantization, checksums) in place with fn; an edited
    config gets a matching `config_crc32`, as if the file had been written that way."""
    from tinyloop.format.header import config_crc32

    def go(doc: dict[str, Any]) -> None:
        meta = doc["__metadata__"]
        value = json.loads(meta[key])
        fn(value)
        meta[key] = json.dumps(value)
        if key == "config" and "config_crc32" in meta:
            meta["config_crc32"] = config_crc32(meta[key])

    edit_header(path, go)


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def src_env() -> dict[str, str]:
    """Environment for a subprocess that imports tinyloop from the same place as this process."""
    import tinyloop

    src = str(Path(next(iter(tinyloop.__path__))).parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
