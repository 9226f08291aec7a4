"""Which KV slot each (stage, loop iteration, layer) uses: prelude, coda, then loop-major body."""

from __future__ import annotations

from tinyloop.config import ArchConfig


def prelude_slot(cfg: ArchConfig, layer: int) -> int:
    return layer


def coda_slot(cfg: ArchConfig, layer: int) -> int:
    return cfg.n_prelude + layer


def body_slot(cfg: ArchConfig, loop: int, layer: int) -> int:
    """Loop-major, so that a cache for more loops only appends slots."""
    return cfg.n_prelude + cfg.n_coda + loop * cfg.n_body + layer
