"""The Gluon decode GEMV's CPU-checkable parts: its nibble-to-float bit trick (the PRMT selectors it emits,
emulated) rebuilds the weight exactly, and the launcher only takes the cases the kernel is written for.
The kernel itself runs only on a GPU (Gluon has no interpreter); bench/gpu_suite.py's gluon section checks
it there against float64 and the Triton GEMV."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tinyloop.kernels import cuda_ops, gluon_gemv
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.quant import BlockedInt4Weight, quantize_int4


def _prmt(a: np.ndarray, b: int, selector: int) -> np.ndarray:
    """PTX prmt.b32 (default mode): result byte i is byte (selector >> 4i) & 7 of the pair (b:a)."""
    pool = [(a >> (8 * k)) & 0xFF for k in range(4)] + [np.full_like(a, (b >> (8 * k)) & 0xFF) for k in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        pick = (selector >> (4 * i)) & 0xF
        assert pick < 8, "sign-replicating selectors are not emulated"
        out |= pool[pick] << (8 * i)
    return out


def _nibble_floats(words: np.ndarray) -> list[np.ndarray]:
    """What the kernel computes per nibble j: lo / hi bytes 0x80 | q << 3, then one PRMT each."""
    w = words.astype(np.int64) & 0xFFFFFFFF
    signed = words.astype(np.int64)  # >> on the int32 in the kernel is arithmetic
    lo = ((w << 3) & 0x78787878) | 0x80808080
    hi = (((signed >> 1) & 0xFFFFFFFF) & 0x78787878) | 0x80808080
    selectors = [int(re.search(r"0x([0-9a-f]+);", s).group(1), 16) for s in gluon_gemv._PRMT.value]  # type: ignore[union-attr]
    out = []
    for j in range(8):
        bits = _prmt(lo if j % 2 == 0 else hi, gluon_gemv.PRMT_HIGH_BYTE, selectors[j // 2])
        out.append(bits.astype(np.uint32).view(np.float32))
    return out


def test_nibble_floats_are_one_plus_code_over_16() -> None:
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, 4096, dtype=np.int64).astype(np.int32)
    words[:2] = [-1, 0]  # all nibbles 15 (sign bit set) and all 0
    for j, f in enumerate(_nibble_floats(words)):
        q = (words.astype(np.int64) >> (4 * j)) & 0xF
        np.testing.assert_array_equal(f, 1 + q.astype(np.float32) / 16)


def test_kernel_column_order_rebuilds_the_weight() -> None:
    """Column blk * 64 + 8 j + i of the kernel's x gathering holds nibble j of word i of the block: the
    weight rebuilt that way, with the per-block scale / minimum algebra the kernel uses, is the weight."""
    gen = torch.Generator().manual_seed(3)
    q = quantize_int4(torch.randn(6, 256, generator=gen), 64)
    blocked = BlockedInt4Weight.from_int4(q)
    words = blocked.packed.view(torch.int32).numpy().reshape(6, 4, 8)  # [rows, blocks, words]
    floats = _nibble_floats(words)  # per j: [rows, blocks, words] of 1 + q / 16
    scale, minimum = blocked.scale.float().numpy(), blocked.minimum.float().numpy()
    dense = np.zeros((6, 256), np.float64)
    for j in range(8):
        codes = 16 * (floats[j].astype(np.float64) - 1)
        for i in range(8):
            cols = np.arange(4) * 64 + 8 * j + i
            dense[:, cols] = codes[:, :, i] * scale + minimum
    np.testing.assert_allclose(dense, q.dequantize(torch.float64).numpy(), rtol=0, atol=1e-6)


def test_launcher_takes_only_what_the_kernel_is_written_for(monkeypatch: pytest.MonkeyPatch) -> None:
    w64 = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(8, 128), 64))
    w32 = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(8, 128), 32))
    x = torch.randn(1, 128)
    policy = KernelPolicy(gluon_gemv_max_rows=4)
    assert not cuda_ops._gluon_applies(policy, x, w64, 1)  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert cuda_ops._gluon_applies(policy, x, w64, 1)
    assert cuda_ops._gluon_applies(policy, x, w64, 4)
    assert not cuda_ops._gluon_applies(policy, x, w64, 5)  # up to gluon_gemv_max_rows rows
    assert not cuda_ops._gluon_applies(policy, x, w32, 1)  # 64-column groups only


@pytest.mark.parametrize(
    ("staged_on", "staged_runs", "gluon_on", "expected"),
    [(True, True, True, ["staged"]), (True, False, True, ["staged", "gluon"]), (False, True, True, ["gluon"]),
     (True, False, False, ["staged"]), (False, True, False, [])],
)  # fmt: skip
def test_dispatch_order(monkeypatch: pytest.MonkeyPatch, staged_on: bool, staged_runs: bool, gluon_on: bool,
                                expected: list[str]) -> None:  # fmt: skip
    calls: list[str] = []
    policy = KernelPolicy(staged_gemv=staged_on, gluon_gemv=gluon_on)
    monkeypatch.setattr(cuda_ops, "_gemv_staged", lambda *a: calls.append("staged") or staged_runs)
    monkeypatch.setattr(cuda_ops, "_gemv_gluon", lambda *a: calls.append("gluon") or True)
    ran = cuda_ops._gemv_gluon_rows(policy, torch.randn(1, 64), None, None)
    assert calls == expected
    assert ran == ((staged_on and staged_runs) or gluon_on)

    calls.clear()
    assert cuda_ops._gemv_gluon_rows(policy, torch.randn(2, 64), None, None) == gluon_on
    assert calls == (["gluon"] if gluon_on else [])  # the staged GEMV is one row's only


@pytest.mark.parametrize(("n", "k", "act"), [(6144, 2048, 0), (5632, 2048, 1), (2048, 5632, 0), (32000, 2048, 0),
                                             (1152, 384, 1), (1000, 1024, 2)])  # fmt: skip
@pytest.mark.parametrize("x_rows", [1, 2, 3, 4, 8])
def test_tiles_fit_a_warp(n: int, k: int, act: int, x_rows: int) -> None:
    rows, lanes_rows, per_thread, warps_rows, warps_blocks = KernelPolicy().gluon_tile(n, k, act, x_rows)
    assert 16 % lanes_rows == 0 and min(rows, per_thread, warps_rows, warps_blocks) >= 1
    assert (warps_rows * warps_blocks) & (warps_rows * warps_blocks - 1) == 0  # a power of two
