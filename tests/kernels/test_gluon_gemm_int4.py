"""The Gluon INT4 GEMM for short prefills (kernels/gluon_gemm_int4.py): its nibble order emulated in torch, and
the launcher's routing (which product, which fused bias / residual) against the cuBLAS path, with the kernel
replaced by a float64 stand-in. The kernel itself needs Hopper: bench/gpu_suite.py gluon_gemm checks it on the
GPU against float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tinyloop.kernels import cuda_ops
from tinyloop.kernels import gluon_gemm_int4 as gemm
from tinyloop.quant import BlockedInt4Weight, quantize_int4


def test_a_step_dequantizes_its_words_in_column_order() -> None:
    """The kernel's dequantization of one 64-column step (words [BN, 8] -> nibble j of word i is column 8 j + i,
    q * scale + minimum in float32), emulated with the same index arithmetic, equals the weight's own
    dequantize()."""
    q = quantize_int4(torch.randn(24, 256) / 20, 64)
    w = BlockedInt4Weight.from_int4(q)
    words = w.packed.view(torch.int32).view(24, 256 // 8)
    dense = w.dequantize()
    for step in range(256 // 64):
        step_words = words[:, step * 8 : (step + 1) * 8]  # [BN, 8 (i)]
        shifts = torch.arange(8, dtype=torch.int32) * 4  # nibble j
        codes = (step_words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BN, 8 (j), 8 (i)]
        magic = (codes | 0x4B000000).view(torch.float32) - 8388608.0
        s, mn = w.scale[:, step, None, None].float(), w.minimum[:, step, None, None].float()
        got = (magic * s + mn).reshape(24, 64)
        assert torch.equal(got, dense[:, step * 64 : (step + 1) * 64].float())


def test_applies_to_16_bit_x_and_whole_64_column_groups() -> None:
    assert gemm.applies(2048, 64, 2) and gemm.applies(5632, 64, 2)
    assert not gemm.applies(2048, 64, 4)  # float32 x keeps cuBLAS
    assert not gemm.applies(2048, 32, 2)  # other group sizes
    assert not gemm.applies(2048 + 32, 64, 2)


class _Float64Gemm:
    """Stands in for the kernel launch: out = x @ w.T (+ bias) (+ residual) in float64, rounded once."""

    def __init__(self, calls: list[dict[str, Any]]) -> None:
        self.calls = calls

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(x_desc: Any, w_desc: Any, s: torch.Tensor, mn: torch.Tensor, out: torch.Tensor,
                   res: torch.Tensor, b: torch.Tensor, ws: torch.Tensor, count: torch.Tensor, M: int, N: int, K: int,
                   *_: int, **kw: Any) -> None:  # fmt: skip
            w = BlockedInt4Weight(w_desc.base.view(torch.uint8).view(N, K // 2), s, mn, 64)
            y = x_desc.base.double() @ w.dequantize().double().T
            if kw["BIAS"]:
                y = y + b.double()
            if kw["RESIDUAL"]:
                y = y + res.double()
            out.copy_(y.to(out.dtype))
            self.calls.append({"grid": grid, "M": M, "N": N, "K": K, **kw})

        return launch


@pytest.mark.parametrize("case", ["plain", "bias", "residual", "swiglu", "gelu+residual", "norm+bias+residual"])
def test_prefill_products_route_through_the_gluon_gemm_like_cublas(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    act = {"swiglu": cuda_ops.ACT_SWIGLU, "gelu+residual": cuda_ops.ACT_GELU}.get(case, cuda_ops.ACT_NONE)
    n, k, rows = 96, 256, 40
    w = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(2 * n if act == cuda_ops.ACT_SWIGLU else n, k,
                                                              generator=gen) / 20, 64))  # fmt: skip
    x = torch.randn(rows, k, generator=gen).bfloat16()
    kw: dict[str, Any] = {"act": act}
    if "bias" in case:
        kw["bias"] = (0.1 * torch.randn(n, generator=gen)).bfloat16()
    if "residual" in case:
        kw["residual"] = torch.randn(rows, n, generator=gen).bfloat16()
    if "norm" in case:
        kw.update(norm_weight=(1 + 0.1 * torch.randn(k, generator=gen)).bfloat16(), eps=1e-6)
    want = cuda_ops.fused_linear(x, w, **kw)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cuda_ops, "USE_GLUON_GEMM", True)
    monkeypatch.setattr(gemm, "_gemm_int4_kernel", _Float64Gemm(calls))
    got = cuda_ops.fused_linear(x, w, **kw)
    assert len(calls) == 1 and calls[0]["M"] == rows and calls[0]["K"] == k
    # Bias and residual are fused into the product where cuBLAS fuses them (addmm), not both at once.
    assert calls[0]["BIAS"] == ("bias" in case)
    assert calls[0]["RESIDUAL"] == (case == "residual")
    assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2
    monkeypatch.setattr(cuda_ops, "GLUON_GEMM_MAX_ROWS", rows - 1)  # too many rows: cuBLAS again
    calls.clear()
    cuda_ops.fused_linear(x, w, **kw)
    assert not calls


def test_product_adds_the_residual_into_a_new_output_too() -> None:
    """`_product` without an output tensor still adds the residual (the GPU check of session 11 called it so and
    the cuBLAS path dropped it), and refuses a bias and a residual together."""
    gen = torch.Generator().manual_seed(4)
    w = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(64, 128, generator=gen) / 20, 64))
    x, r = torch.randn(20, 128, generator=gen), torch.randn(20, 64, generator=gen)
    got = cuda_ops._product(x, w, None, r, None)
    want = x.double() @ w.dequantize().double().T + r.double()
    assert (got.double() - want).norm() / want.norm() < 1e-5
    with pytest.raises(ValueError, match="not both"):
        cuda_ops._product(x, w, torch.zeros(64), r, None)
