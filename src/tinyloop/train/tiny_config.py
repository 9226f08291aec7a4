"""Architecture configs the trainer knows: the shipped `tiny` model and a CPU test-sized one."""

from __future__ import annotations

from tinyloop.config import ArchConfig

TINY_CONFIG = ArchConfig(
    vocab_size=256, d_model=384, n_heads=6, n_kv_heads=6, head_dim=64, ffn_dim=1024, ffn_kind="swiglu",
    norm_kind="rmsnorm", norm_eps=1e-6, norm_placement="pre", rope_base=10000.0, rope_pairing="half",
    n_prelude=2, n_body=4, n_coda=2, default_loops=8, injection="concat", state_start="zeros",
    loop_norm="none", head_norm=True, tied_embeddings=True, max_position=4096, name="tiny", family="tinyloop",
)  # fmt: skip

# Same architecture family at toy width, for CPU tests of the training loop (INT4-exportable: every
# matrix's input width is a multiple of 64).
TEST_TINY_TRAIN_CONFIG = ArchConfig(
    vocab_size=256, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=128, ffn_kind="swiglu",
    n_prelude=1, n_body=2, n_coda=1, default_loops=4, injection="concat", state_start="zeros",
    loop_norm="none", head_norm=True, tied_embeddings=True, max_position=512, name="test-tiny-train",
)  # fmt: skip

TRAIN_CONFIGS: dict[str, ArchConfig] = {"tiny": TINY_CONFIG, "test-tiny-train": TEST_TINY_TRAIN_CONFIG}


def train_config(name: str) -> ArchConfig:
    try:
        return TRAIN_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown training config {name!r}; choose one of {sorted(TRAIN_CONFIGS)}") from None
