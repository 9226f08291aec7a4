"""The tensor-core INT4 kernel's CPU-checkable parts: its decoding PTX (interpreted here line by line) turns a
CudaMmaInt4Weight word into the 8 weights of 8 consecutive columns, as (q - 8) * scale + zero rounded once to
16 bits; the copy keeps the INT4 codes and the kernel's tiles divide what the launcher gives it. The kernel itself
runs only on a GPU (Gluon has no interpreter): bench/int4_mma_rows.py checks it there against float32."""

from __future__ import annotations

import re

import pytest
import torch

from tinyloop.kernels import gluon_int4_mma
from tinyloop.kernels.cuda_ops import _k_splits, mma_int4_applies
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.quant import MMA_MAX_X_TILES, BlockedInt4Weight, CudaMmaInt4Weight, quantize_int4

MASK32 = 0xFFFFFFFF


def _halves(value: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([value & 0xFFFF, value >> 16], dtype=torch.int32).to(torch.int16).view(dtype)


def _pack(halves: torch.Tensor) -> int:
    low, high = (int(v) & 0xFFFF for v in halves.view(torch.int16))
    return low | high << 16


def _prmt(a: int, b: int, selector: int) -> int:
    pool = [(a >> 8 * k) & 0xFF for k in range(4)] + [(b >> 8 * k) & 0xFF for k in range(4)]
    return sum(pool[(selector >> 4 * i) & 0x7] << 8 * i for i in range(4))


def _run_ptx(asm: str, inputs: dict[str, int], dtype: torch.dtype) -> dict[str, int]:
    """The registers after running asm (the PTX subset the decoding uses) from `inputs`."""
    regs: dict[str, int] = {name: value & MASK32 for name, value in inputs.items()}

    def val(token: str) -> int:
        return int(token, 16) if token.startswith("0x") else regs[token]

    for line in asm.splitlines():
        m = re.match(r"([\w.]+) (.+);$", line.strip())
        if m is None or m.group(1) == ".reg":
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        if op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "shr.u32":
            regs[args[0]] = val(args[1]) >> int(args[2])
        elif op == "lop3.b32":
            assert args[4] == "0xEA", "only (a & b) | c is interpreted"
            regs[args[0]] = (val(args[1]) & val(args[2])) | val(args[3])
        elif op.startswith("sub.rn."):
            a, b = (_halves(val(t), dtype).double() for t in args[1:3])
            regs[args[0]] = _pack((a - b).to(dtype))
        elif op.startswith("fma.rn."):
            a, b, c = (_halves(val(t), dtype).double() for t in args[1:4])
            regs[args[0]] = _pack((a * b + c).to(dtype))
        else:
            raise AssertionError(f"uninterpreted instruction {op}")
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoding_ptx_gives_the_copys_weights_in_column_order(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = quantize_int4(torch.randn(8, 128), 64)
    copy = CudaMmaInt4Weight.from_int4(BlockedInt4Weight.from_int4(w), dtype)
    asm_constant = gluon_int4_mma._DEQUANT_F16 if dtype == torch.float16 else gluon_int4_mma._DEQUANT_BF16
    asm = getattr(asm_constant, "value", asm_constant)  # a plain string where Triton is not installed
    split = getattr(gluon_int4_mma._SPLIT_PAIR, "value", gluon_int4_mma._SPLIT_PAIR)
    expected = copy.dequantize()
    for row in range(8):
        for word in range(16):
            halves = _run_ptx(split, {"$2": int(copy.pairs[row, word * 8 // 64])}, dtype)  # once per group
            regs = _run_ptx(asm, {"$4": int(copy.words[row, word]), "$12": halves["$0"], "$20": halves["$1"]}, dtype)
            got = torch.cat([_halves(regs[f"${j}"], dtype) for j in range(4)])
            assert torch.equal(got, expected[row, 8 * word : 8 * word + 8]), (row, word)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_keeps_the_codes_and_rounds_scale_and_minimum_once(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    w = quantize_int4(torch.randn(32, 256), 64)
    for source in (w, BlockedInt4Weight.from_int4(w)):
        copy = CudaMmaInt4Weight.from_int4(source, dtype)
        counters = 32 // 16 * MMA_MAX_X_TILES  # a tile of 16 weight rows and 8 x rows each, zero between launches
        assert torch.equal(copy.arrivals, torch.zeros(counters, dtype=torch.int32))
        assert copy.shape == w.shape and copy.nbytes == w.packed.nbytes + 4 * w.scale.numel() + 4 * counters
        assert torch.equal(copy.codes(), w.codes(w.packed).to(torch.int32))
        s16 = w.scale.to(dtype).double()
        z16 = (w.minimum.float() + 8 * w.scale.float()).to(dtype).double()
        q = w.codes(w.packed).double().unflatten(-1, (-1, 64)) - 8
        assert torch.equal(copy.dequantize(), (q * s16[..., None] + z16[..., None]).flatten(-2).to(dtype))
        exact = w.dequantize(torch.float64)
        assert (copy.dequantize().double() - exact).abs().max() <= 0.02 * exact.abs().max()


def test_copy_refuses_what_the_kernel_cannot_decode() -> None:
    w = quantize_int4(torch.randn(8, 64), 64)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        CudaMmaInt4Weight.from_int4(w, torch.float32)


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("rows", [3, 4, 8, 9, 16, 17, 32, 33, 64])
def test_default_tiles_cover_the_row_counts_and_divide_the_model_shapes(rows: int, wgmma: bool) -> None:
    policy = KernelPolicy(mma_int4=True, mma_int4_wgmma=wgmma)
    warps, row_tiles, block_k, rows_x = policy.mma_int4_tile(2048, 2048, rows)
    assert 16 <= rows_x <= 64 and (rows <= rows_x or wgmma and rows_x == 32) and block_k in (64, 128, 256)
    for n, k in ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048), (49152, 2048)):
        assert mma_int4_applies(policy, _shaped(n, k), rows), (n, k)
    assert not mma_int4_applies(policy, _shaped(40, 128), rows)
    # 192 rows hold three 64-row tiles but not two halves of whole tiles (a [gate; up] matrix's features).
    assert not mma_int4_applies(policy, _shaped(192, 2048), rows)
    assert not mma_int4_applies(policy, _shaped(2048, 2048, group=256), rows)


def _shaped(n: int, k: int, group: int = 64) -> CudaMmaInt4Weight:
    """A copy of an n x k matrix (contents irrelevant: only its shape is read)."""
    words, pairs = torch.ones(n, k // 8, dtype=torch.int32), torch.ones(n, k // group, dtype=torch.int32)
    arrivals = torch.zeros(n // 16 * MMA_MAX_X_TILES, dtype=torch.int32)
    return CudaMmaInt4Weight(words, pairs, group, torch.bfloat16, arrivals)


def test_the_warpgroup_version_takes_its_rows_from_2_and_the_mma_sync_version_from_8() -> None:
    wgmma, mma_sync = KernelPolicy(mma_int4=True, mma_int4_wgmma=True), KernelPolicy(mma_int4=True)
    assert [wgmma.mma_int4_takes_rows(rows) for rows in (1, 2, 32, 33)] == [False, True, True, False]
    wider = KernelPolicy(mma_int4=True, mma_int4_wgmma=True, mma_int4_wgmma_max_rows=64)
    assert [wider.mma_int4_takes_rows(rows) for rows in (32, 64, 65)] == [True, True, False]
    assert [mma_sync.mma_int4_takes_rows(rows) for rows in (7, 8, 32, 33)] == [False, True, True, False]
    assert not KernelPolicy(mma_int4_wgmma=True).mma_int4_takes_rows(8)  # the kernel itself switched off
    # whole warpgroups (4 or 8 warps) and x tiles wgmma's N can take
    for shape in ((6144, 2048), (11264, 2048), (2048, 2048), (2048, 5632)):
        for rows in (2, 5, 8, 16, 32, 64):
            warps, _, _, rows_x = wgmma.mma_int4_tile(*shape, rows)
            assert warps % 4 == 0 and rows_x in (16, 32, 64)


def test_warpgroup_tiles_take_64_x_rows_at_once_only_for_tall_matrices() -> None:
    policy = KernelPolicy(mma_int4=True, mma_int4_wgmma=True)
    assert policy.mma_int4_tile(11264, 2048, 64)[3] == 64  # gate / up: 5.5 times as tall as wide
    assert [policy.mma_int4_tile(n, k, 64)[3] for n, k in ((6144, 2048), (2048, 2048), (2048, 5632))] == [32] * 3
    assert policy.mma_int4_tile(6144, 2048, 32)[:2] == (4, 2) and policy.mma_int4_tile(2048, 5632, 32)[:2] == (8, 1)


def test_k_splits_fill_the_programs_under_the_cap_and_leave_no_split_empty() -> None:
    assert _k_splits(264, 16, 16) == (16, 1)
    assert _k_splits(264, 16, 16, max_splits=4) == (4, 4)
    assert _k_splits(264, 44, 16, max_splits=8) == (8, 6)  # 7 full splits of 6 K tiles and one of 2
    assert _k_splits(264, 16, 88) == (3, 6)
    assert _k_splits(132, 16, 176, max_splits=8) == (1, 16)
