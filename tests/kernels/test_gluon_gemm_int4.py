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


def _run_pair_asm(asm: str, regs: dict[str, int]) -> int:
    """Executes the kernel's pair asm (mov, prmt, shr, lop3, packed 16-bit fma) on 32-bit values; the packed
    fma rounds each half once from its exact value, as the hardware's fma.rn does."""
    half = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}

    def value(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    def halves(v: int, dt: torch.dtype) -> torch.Tensor:
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(dt).double()

    for line in asm.strip("{} ").split(";"):
        op, _, rest = line.strip().partition(" ")
        if not op or op.startswith(".reg"):
            continue
        args = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            regs[args[0]] = value(args[1])
        elif op == "prmt.b32":
            a, b, sel = value(args[1]), value(args[2]), value(args[3])
            pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            regs[args[0]] = sum(pool[(sel >> 4 * i) & 0x7] << 8 * i for i in range(4))
        elif op == "shr.u32":
            regs[args[0]] = value(args[1]) >> value(args[2])
        elif op == "lop3.b32":
            assert value(args[4]) == 0xEA  # (a & b) | c
            regs[args[0]] = (value(args[1]) & value(args[2])) | value(args[3])
        elif op.startswith("fma.rn."):
            dt = half[op.split(".")[-1]]
            exact = halves(value(args[1]), dt) * halves(value(args[2]), dt) + halves(value(args[3]), dt)
            bits = exact.to(dt).view(torch.int16).to(torch.int32) & 0xFFFF
            regs[args[0]] = int(bits[0]) | int(bits[1]) << 16
        else:
            raise AssertionError(f"unknown instruction {op}")
    return regs["$0"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_pair_asm_dequantizes_each_column_pair_of_a_step(dtype: torch.dtype) -> None:
    """Each of the kernel's eight pair programs, run instruction by instruction on words 2 t and 2 t + 1 of a
    64-column step (column 8 j + i is nibble j of word i), gives columns 16 kk + 8 odd + 2 t and the next one
    as q * scale + minimum rounded once, scale and minimum in x's dtype."""
    gen = torch.Generator().manual_seed(5)
    q = quantize_int4(torch.randn(6, 128, generator=gen) / 20, 64)
    w = BlockedInt4Weight.from_int4(q)
    words = w.packed.view(torch.int32).view(6, 2, 8)
    codes = q.codes(q.packed).view(6, 2, 64).double()
    asms = gemm._PAIRS_FP16 if dtype == torch.float16 else gemm._PAIRS_BF16
    for row in range(6):
        for step in range(2):
            s16 = w.scale[row, step].to(dtype)
            m16 = w.minimum[row, step].to(dtype)
            pair_of = lambda v: int(v.view(torch.int16)) & 0xFFFF  # noqa: E731
            s2, m2 = pair_of(s16) * 0x10001, pair_of(m16) * 0x10001
            for t in range(4):
                wa, wb = (int(words[row, step, 2 * t + e]) & 0xFFFFFFFF for e in range(2))
                for c in range(8):
                    kk, odd = c // 2, c % 2
                    got = _run_pair_asm(asms.value[c], {"$1": wa, "$2": wb, "$3": s2, "$4": m2})
                    col = 16 * kk + 8 * odd + 2 * t
                    want = codes[row, step, col : col + 2] * s16.double() + m16.double()
                    halves = torch.tensor([got & 0xFFFF, got >> 16], dtype=torch.int32).to(torch.int16).view(dtype)
                    assert torch.equal(halves, want.to(dtype)), (row, step, t, c)


def test_a_step_tile_is_its_pairs_joined_and_permuted_into_column_order() -> None:
    """`_dequantize`'s shape arithmetic, emulated: pair c (kk = c // 2, odd = c % 2) of words 2 t, 2 t + 1 per row,
    joined innermost-first like gl.join and permuted by TILE_ORDER, is the step's 64 columns in order."""
    gen = torch.Generator().manual_seed(6)
    q = quantize_int4(torch.randn(8, 64, generator=gen) / 20, 64)
    w = BlockedInt4Weight.from_int4(q)
    words = w.packed.view(torch.int32).view(8, 4, 2)  # [row, t, e]: word 2 t + e
    s2 = (w.scale[:, 0].view(torch.int16).to(torch.int32) & 0xFFFF) * 0x10001
    m2 = (w.minimum[:, 0].view(torch.int16).to(torch.int32) & 0xFFFF) * 0x10001
    pairs = torch.zeros(8, 8, 4, 2, dtype=torch.float16)  # [c, row, t, e]
    for row in range(8):
        for t in range(4):
            wa, wb = (int(words[row, t, e]) & 0xFFFFFFFF for e in range(2))
            for c in range(8):
                got = _run_pair_asm(gemm._PAIRS_FP16.value[c], {"$1": wa, "$2": wb, "$3": int(s2[row]),
                                                                 "$4": int(m2[row])})  # fmt: skip
                pairs[c, row, t] = torch.tensor([got & 0xFFFF, got >> 16], dtype=torch.int32).to(torch.int16).view(
                    torch.float16)  # fmt: skip

    def join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.stack((a, b), dim=-1)

    p = pairs
    d = join(join(join(p[0], p[1]), join(p[2], p[3])), join(join(p[4], p[5]), join(p[6], p[7])))
    tile = d.permute(*gemm.TILE_ORDER).reshape(8, 64)
    assert torch.equal(tile, w.dequantize(torch.float16))


def test_split_k_never_leaves_a_split_empty() -> None:
    for tiles in (1, 16, 32, 48, 96, 200):
        for groups in (1, 4, 5, 32, 88):
            for asked in (0, 1, 2, 3, 7, 8, 200):
                split = cuda_ops._gluon_gemm_split(tiles, groups, asked, 132)
                assert 1 <= split <= max(1, groups)
                assert (split - 1) * -(-groups // split) < groups  # the last split starts inside K
                if asked > 0 and asked <= groups:
                    assert split <= asked
    assert cuda_ops._gluon_gemm_split(32, 32, 0, 132) == 4  # out at 128 rows: 32 tiles on 132 SMs
    assert cuda_ops._gluon_gemm_split(96, 32, 0, 132) == 1
    assert cuda_ops._gluon_gemm_split(16, 88, 0, 132) == 8


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


def test_split_k_scratch_is_zero_and_grows_only_when_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workspace and counters start at zero (each call's last program per tile restores that), are reused
    while large enough, and are reallocated larger (never smaller) when a call needs more."""
    monkeypatch.setattr(cuda_ops, "_GLUON_GEMM_SCRATCH", {})
    cpu = torch.device("cpu")
    ws, count = cuda_ops._gluon_gemm_scratch(cpu, 1000, 10) or (None, None)
    assert ws is not None and count is not None
    assert ws.numel() == 1000 and count.numel() == 10 and not ws.any() and not count.any()
    again = cuda_ops._gluon_gemm_scratch(cpu, 500, 4)
    assert again is not None and again[0] is ws and again[1] is count
    bigger = cuda_ops._gluon_gemm_scratch(cpu, 2000, 4)
    assert bigger is not None and bigger[0].numel() == 2000 and bigger[1].numel() == 10


def test_the_k_over_n_policy_keeps_wide_products_on_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLUON_GEMM_MIN_K_OVER_N 2: products with K at least 2 N (like a down projection) go to the Gluon GEMM, a
    QKV-like and a square one stay on cuBLAS."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cuda_ops, "USE_GLUON_GEMM", True)
    monkeypatch.setattr(cuda_ops, "GLUON_GEMM_MIN_K_OVER_N", 2.0)
    monkeypatch.setattr(gemm, "_gemm_int4_kernel", _Float64Gemm(calls))
    gen = torch.Generator().manual_seed(8)
    for n, k, routed in ((64, 128, True), (32, 192, True), (192, 128, False), (64, 64, False)):
        w = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(n, k, generator=gen) / 20, 64))
        calls.clear()
        cuda_ops._product(torch.randn(24, k, generator=gen).bfloat16(), w, None, None, None)
        assert bool(calls) == routed, (n, k)
