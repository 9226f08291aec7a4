"""The kernel policy: built once from the environment, frozen, and its tile rules give the measured tiles (the
fused decoder launching with its engine's policy: test_fused_decode.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_backend
from tinyloop.kernels.policy import ACT_NONE, ACT_SWIGLU, KernelPolicy

SRC = Path(__file__).resolve().parents[2] / "src" / "tinyloop"

# Switch -> the fields it sets and their values with the variable set, for the switches that need no GPU support.
PLAIN_SWITCHES: dict[str, dict[str, object]] = {
    "TINYLOOP_DISABLE_CUBLAS_FP16": {"cublas_16bit": False},
    "TINYLOOP_DISABLE_FLASH2_PREFILL": {"sdpa_math_only": True},
    "TINYLOOP_USE_CUDNN_SDPA": {"sdpa_cudnn": True},
    "TINYLOOP_PERSISTENT_DECODE": {"persistent_decode": True, "attention_out_max_rows": 1},
}
# Switches of kernels the GPU must support: on where supported, off where the variable says so.
GPU_SWITCHES = {
    "TINYLOOP_DISABLE_PDL": ("pdl", "pdl_supported"),
    "TINYLOOP_DISABLE_GLUON_GEMV": ("gluon_gemv", "gluon_supported"),
    "TINYLOOP_DISABLE_STAGED_GEMV": ("staged_gemv", "staged_supported"),
    "TINYLOOP_DISABLE_TINYGEMM": ("tinygemm", "tinygemm_supported"),
    "TINYLOOP_DISABLE_MMA_INT4": ("mma_int4", "mma_int4_supported"),
}
ALL_SWITCHES = [*PLAIN_SWITCHES, *GPU_SWITCHES]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ALL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_without_a_gpu_are_the_plain_policy(clean_env: pytest.MonkeyPatch) -> None:
    assert cuda_backend.kernel_policy(RuntimeEnv.read()) == KernelPolicy()


@pytest.mark.parametrize("name", sorted(PLAIN_SWITCHES))
def test_each_plain_switch_is_read(name: str, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(name, "1")
    policy = cuda_backend.kernel_policy(RuntimeEnv.read())
    assert {field: getattr(policy, field) for field in PLAIN_SWITCHES[name]} == PLAIN_SWITCHES[name]
    defaults = {field: getattr(KernelPolicy(), field) for field in PLAIN_SWITCHES[name]}
    assert dataclasses.replace(policy, **defaults) == KernelPolicy()


@pytest.mark.parametrize("name", sorted(GPU_SWITCHES))
def test_each_gpu_switch_is_read(name: str, clean_env: pytest.MonkeyPatch) -> None:
    for other in GPU_SWITCHES.values():
        clean_env.setattr(cuda_backend, other[1], lambda: True)
    clean_env.setattr(cuda_backend, "triton_available", lambda: True)
    on = cuda_backend.kernel_policy(RuntimeEnv.read())
    assert on.pdl and on.gluon_gemv and on.staged_gemv and on.tinygemm and on.mma_int4
    clean_env.setenv(name, "1")
    off = cuda_backend.kernel_policy(RuntimeEnv.read())
    field = GPU_SWITCHES[name][0]
    assert not getattr(off, field) and dataclasses.replace(off, **{field: True}) == on


def test_policy_is_frozen_and_its_tables_read_only() -> None:
    tiles = {(64, 128, 1): (4, 2, 1)}
    policy = KernelPolicy(blocked_tiles=tiles)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.pdl = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        policy.blocked_tiles[(64, 128, 1)] = (8, 8, 4)  # type: ignore[index]
    tiles[(64, 128, 1)] = (8, 8, 4)  # the caller's dict is copied
    assert policy.blocked_tile(64, 128, 1) == (4, 2, 1)
    with pytest.raises(ValueError, match="staged_launch_dependents"):
        KernelPolicy(staged_launch_dependents="early")


# The tiles chosen before the rules replaced the per-shape tables: seed-407m's matrices (d_model 2048, ffn 5632,
# vocabulary 32000) and the built-in model's (d_model 384, 6 heads of 64, ffn 1024, vocabulary 256, concat
# adapter 768 -> 384, exit gate).
SEED_BLOCKED = {(6144, 2048): (4, 8, 2), (2048, 2048): (4, 16, 4), (5632, 2048): (4, 8, 2), (2048, 5632): (4, 32, 8),
                (32000, 2048): (4, 8, 2)}  # fmt: skip
SEED_GLUON = {(6144, 2048, 0): (4, 1, 1, 4, 1), (2048, 2048, 0): (4, 1, 1, 2, 2), (5632, 2048, 1): (2, 2, 1, 2, 1),
              (2048, 5632, 0): (4, 1, 1, 2, 2), (32000, 2048, 0): (8, 1, 1, 1, 1)}  # fmt: skip
TINY_BLOCKED = {(1152, 384): (4, 16, 4), (384, 384): (4, 16, 4), (1024, 384): (4, 16, 4), (384, 1024): (4, 16, 4),
                (256, 384): (4, 16, 4), (384, 768): (4, 16, 4), (1, 384): (4, 16, 4)}  # fmt: skip
TINY_GLUON = {(1152, 384, 0): (4, 2, 1, 2, 1), (384, 384, 0): (4, 2, 1, 2, 1), (1024, 384, 1): (2, 2, 1, 2, 1),
              (384, 1024, 0): (4, 1, 1, 2, 2), (256, 384, 0): (4, 2, 1, 2, 1), (384, 768, 0): (4, 2, 1, 2, 1),
              (1, 384, 0): (4, 2, 1, 2, 1)}  # fmt: skip


def test_tile_rules_give_the_measured_tiles() -> None:
    policy = KernelPolicy()
    for (n, k), tile in {**SEED_BLOCKED, **TINY_BLOCKED}.items():
        assert policy.blocked_tile(n, k, 1) == tile, (n, k)
    for (n, k, act), tile in {**SEED_GLUON, **TINY_GLUON}.items():
        assert policy.gluon_tile(n, k, act) == tile, (n, k, act)
    staged = {shape for shape in [*SEED_GLUON, *TINY_GLUON] if policy.staged_applies(*shape)}
    assert staged == {(6144, 2048, ACT_NONE), (5632, 2048, ACT_SWIGLU)}
    assert policy.attention_block(128) == (256, 8) and policy.attention_block(64) == (128, 4)


def test_one_token_attention_splits_keys_until_about_a_thousand_programs_run() -> None:
    policy = KernelPolicy()
    splits = {rows: policy.rope_attention_tile(rows, 16, 128) for rows in (1, 2, 3, 4, 5, 8, 16, 32, 64, 128)}
    assert {rows: tile[0] for rows, tile in splits.items()} == {
        1: 4, 2: 16, 3: 16, 4: 16, 5: 8, 8: 8, 16: 4, 32: 2, 64: 1, 128: 1
    }  # fmt: skip
    assert splits.pop(1) == policy.one_row_attention_tile == (4, 64, 4)  # the one-row step as it was
    assert {tile[1:] for tile in splits.values()} == {policy.split_attention_tile}
    assert policy.rope_attention_tile(8, 32, 128)[0] == 4  # twice the heads, half the splits
    assert policy.rope_attention_tile(8, 6, 64) == (1, *policy.narrow_head_attention_tile)  # narrow heads whole
    assert policy.rope_attention_tile(1, 16, 128, long_cache=True) == policy.one_row_long_attention_tile == (16, 128, 4)
    assert policy.rope_attention_tile(8, 16, 128, long_cache=True) == splits[8]  # batched steps: by rows alone
    assert [policy.attends_long_cache(rows, keys) for rows, keys in ((1, 511), (1, 512), (2, 4096))] == [
        False, True, False
    ]  # fmt: skip
    tuned = KernelPolicy(rope_attention_tiles={(8, 16, 128): (2, 64, 4)})
    assert tuned.rope_attention_tile(8, 16, 128) == (2, 64, 4) and tuned.rope_attention_tile(4, 16, 128)[0] == 16


@pytest.mark.parametrize("n", [1, 37, 896, 3000, 14336, 151936])
@pytest.mark.parametrize("k", [64, 896, 2560, 4096, 18944])
def test_tile_rules_cover_any_shape(n: int, k: int) -> None:
    policy = KernelPolicy()
    for rows in (1, 2, 4):
        block_n, blocks, warps = policy.blocked_tile(n, k, rows)
        assert block_n >= 1 and blocks >= 1 and warps in (1, 2, 4, 8)
    for act in (0, 1, 2):
        rows_, lanes, per_thread, warps_rows, warps_blocks = policy.gluon_tile(n, k, act)
        assert 16 % lanes == 0 and (warps_rows * warps_blocks) & (warps_rows * warps_blocks - 1) == 0


def test_kernel_choice_is_never_a_rebound_global() -> None:
    """Kernel choice is the policy's: no `global` statement and no USE_* switch in kernels/, and nothing in src/ or
    bench/ assigns to a kernel module's attributes."""
    for path in (SRC / "kernels").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*global\s", text, re.M), path
        assert not re.search(r"^USE_[A-Z_]+\s*=", text, re.M), path
    assign = re.compile(r"\b(cuda_ops|attention_backend|cuda_backend|dispatch|policy)\.[A-Za-z_]+\s*=[^=]")
    for path in [*SRC.rglob("*.py"), *(SRC.parents[1] / "bench").rglob("*.py")]:
        assert not assign.search(path.read_text()), path


def test_the_warpgroup_int4_kernel_follows_its_support_and_the_mma_int4_switch(clean_env: pytest.MonkeyPatch) -> None:
    for _, supported in GPU_SWITCHES.values():
        clean_env.setattr(cuda_backend, supported, lambda: True)
    clean_env.setattr(cuda_backend, "triton_available", lambda: True)
    assert not cuda_backend.kernel_policy(RuntimeEnv.read()).mma_int4_wgmma  # no Hopper GPU here
    clean_env.setattr(cuda_backend, "mma_int4_wgmma_supported", lambda: True)
    assert cuda_backend.kernel_policy(RuntimeEnv.read()).mma_int4_wgmma
    clean_env.setenv("TINYLOOP_DISABLE_MMA_INT4", "1")
    off = cuda_backend.kernel_policy(RuntimeEnv.read())
    assert not off.mma_int4 and not off.mma_int4_wgmma
