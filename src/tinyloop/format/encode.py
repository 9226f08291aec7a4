"""Build a `.tinyloop` header: tensor offsets and the padded JSON bytes (pure stdlib)."""

from __future__ import annotations

import json

from tinyloop.config import ArchConfig
from tinyloop.format.header import config_crc32
from tinyloop.format.spec import (
    DATA_ALIGNMENT,
    FORMAT_NAME,
    QuantInfo,
    StoredSpec,
    expected_stored,
    file_order,
    version_str,
)

PLACEHOLDER_CRC = "00000000"


class HeaderPlan:
    """Where every stored tensor of a config + quantization goes; the header's bytes for given checksums."""

    def __init__(self, cfg: ArchConfig, quant: QuantInfo, extra_metadata: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.quant = quant
        # Optional metadata keys (e.g. `tokenizer`), written after the required ones.
        self.extra_metadata = dict(extra_metadata or {})
        self.stored: dict[str, StoredSpec] = expected_stored(cfg, quant)
        self.offsets: dict[str, tuple[int, int]] = {}
        position = 0
        for s in file_order(list(self.stored.values())):
            self.offsets[s.name] = (position, position + s.nbytes)
            position += s.nbytes
        self.data_bytes = position
        # Checksums have a fixed width, so the header's length does not depend on their values.
        self.data_start = 8 + len(self.header_bytes())

    def header_bytes(self, checksums: dict[str, str] | None = None) -> bytes:
        """The JSON header (without the 8-byte length), padded with spaces to align the data section."""
        crcs = checksums if checksums is not None else dict.fromkeys(self.stored, PLACEHOLDER_CRC)
        config = self.cfg.to_json()
        metadata = {
            "format": FORMAT_NAME,
            "format_version": version_str(self.quant.format_version),
            "config": config,
            "quantization": json.dumps(self.quant.to_json_obj(), separators=(",", ":")),
            "checksums": json.dumps({n: crcs[n] for n in self.stored}, separators=(",", ":")),
            "config_crc32": config_crc32(config),
            **self.extra_metadata,
        }
        doc: dict[str, object] = {"__metadata__": metadata}
        for name, (begin, end) in self.offsets.items():
            s = self.stored[name]
            doc[name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [begin, end]}
        raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
        # Spaces are JSON whitespace; safetensors pads the same way.
        return raw + b" " * (-(8 + len(raw)) % DATA_ALIGNMENT)

    def prefix(self, checksums: dict[str, str] | None = None) -> bytes:
        """The 8-byte little-endian header length followed by the header."""
        header = self.header_bytes(checksums)
        return len(header).to_bytes(8, "little") + header
