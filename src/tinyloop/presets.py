"""Named architecture presets for random-weight models (tests and benchmarks)."""

from __future__ import annotations

from tinyloop.config import ArchConfig

PRESETS: dict[str, ArchConfig] = {
    # The reference runtime's 407M benchmark shape.
    "seed-407m": ArchConfig(
        vocab_size=32000, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128, ffn_dim=5632,
        ffn_kind="swiglu", n_prelude=2, n_body=4, n_coda=2, default_loops=8,
        injection="add", state_start="prelude", tied_embeddings=True, max_position=4096,
        rope_base=10000.0, name="seed-407m",
    ),
    # A few-kilobyte model for unit tests: byte vocabulary, GQA, every stage present.
    "test-tiny": ArchConfig(
        vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
        n_prelude=1, n_body=2, n_coda=1, default_loops=4, injection="concat",
        state_start="zeros", max_position=1024, name="test-tiny",
    ),
    # Ouro-1.4B's shape (24 layers, all looped, 4 loops, sandwich over the sublayer output).
    "ouro-1.4b-shape": ArchConfig(
        vocab_size=49152, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128, ffn_dim=5632,
        norm_placement="sandwich_out", rope_base=1e6, n_prelude=0, n_body=24, n_coda=0,
        default_loops=4, injection="none", state_start="prelude", loop_norm="every_loop",
        head_norm=False, tied_embeddings=False, exit_gate=True, max_position=65536,
        family="ouro", name="ouro-1.4b-shape",
    ),
}  # fmt: skip


def preset(name: str) -> ArchConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
