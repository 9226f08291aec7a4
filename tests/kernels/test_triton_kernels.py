"""Each Triton kernel against a float64 reference written with plain torch ops (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import frob_rel_error, interpreter_policy
from naive_reference import _rope
from tinyloop.config import ArchConfig
from tinyloop.kernels import cuda_ops
from tinyloop.kernels.one_token import OneTokenAttention
from tinyloop.model.layers import apply_rope, rope_tables
from tinyloop.quant import BlockedInt4Weight, CudaTinygemmWeight, Int4Weight, quantize_int4, tinygemm_scales_zeros

POLICY = interpreter_policy()
ops = cuda_ops.CudaKernels(POLICY)  # type: ignore[arg-type]

# float32 matches to rounding; 16-bit results are rounded to 16 bits at the same points as the reference.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def reference(x, w, norm=None, bias=None, act=0, residual=None, eps=1e-6):  # type: ignore[no-untyped-def]
    h = x.double()
    if norm is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm.double()
    y = h @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if act == ops.ACT_SWIGLU:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    elif act == ops.ACT_GELU:
        y = F.gelu(y)
    return y if residual is None else y + residual.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("int4", [True, False], ids=["int4", "dense"])
def test_fused_linear_matches_reference(dtype: torch.dtype, rows: int, int4: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    K, N = 128, 40  # N not a multiple of the tile: masked edges
    raw = torch.randn(2 * N, K, generator=gen) / K**0.5
    weight = quantize_int4(raw, 32) if int4 else raw.to(dtype)
    dense = weight.dequantize() if int4 else raw.to(dtype).float()  # type: ignore[union-attr]
    x = torch.randn(rows, K, generator=gen).to(dtype)
    norm = 1 + 0.1 * torch.randn(K, generator=gen)
    bias = 0.1 * torch.randn(N, generator=gen)
    residual = torch.randn(rows, N, generator=gen).to(dtype)
    cases = [
        (dict(act=ops.ACT_SWIGLU), dict(act=ops.ACT_SWIGLU)),
        (dict(norm_weight=norm, eps=1e-6), dict(norm=norm)),
        (dict(bias=bias, residual=residual), dict(bias=bias, residual=residual)),
        (dict(act=ops.ACT_GELU, norm_weight=norm, eps=1e-6), dict(act=ops.ACT_GELU, norm=norm)),
        (dict(residual=residual), dict(residual=residual)),  # many rows: the sum inside the GEMM
        (dict(bias=bias), dict(bias=bias)),
    ]
    for kwargs, ref_kwargs in cases:
        w = weight if ref_kwargs.get("act") == ops.ACT_SWIGLU else _rows(weight, N)
        wd = dense if ref_kwargs.get("act") == ops.ACT_SWIGLU else dense[:N]
        got = ops.fused_linear(x, w, **kwargs)  # type: ignore[arg-type]
        ref = reference(x.double(), wd, **ref_kwargs)
        assert got.dtype == dtype
        assert frob_rel_error(got, ref) <= TOL[dtype], kwargs


def _rows(w, n):  # type: ignore[no-untyped-def]
    if isinstance(w, Int4Weight):
        return type(w)(w.packed[:n].contiguous(), w.scale[:n].contiguous(), w.minimum[:n].contiguous(), w.group_size)
    return w[:n].contiguous()


# Left out: bfloat16 in the tensor-core kernel (Triton's interpreter multiplies bfloat16 tl.dot operands wrongly;
# checked on the GPU instead) and float16 in the GEMV (its 16-bit path is the one bfloat16 takes).
BLOCKED_CASES = [
    (dtype, rows)
    for rows in (1, 2, 4, 5, 16)
    for dtype in ((torch.float32, torch.bfloat16) if rows <= POLICY.matvec_max_rows else (torch.float32, torch.float16))
]


def one_token_problem(pairing: str, rows: int, hd: int = 16):  # type: ignore[no-untyped-def]
    """A one-token attention problem of 4 query heads and 2 kv heads of `hd` over caches of 300 positions:
    (config, RoPE tables, qkv rows, (keys, values))."""
    H, KVH, S = 4, 2, 300
    gen = torch.Generator().manual_seed(4)
    cfg = ArchConfig(
        vocab_size=64, d_model=64, n_heads=H, n_kv_heads=KVH, head_dim=hd, ffn_dim=64,
        n_prelude=0, n_body=1, n_coda=0, rope_pairing=pairing,
    )  # fmt: skip
    cos, sin = rope_tables(cfg, S, "cpu")
    qkv = torch.randn(rows, (H + 2 * KVH) * hd, generator=gen)
    caches = torch.randn(rows, KVH, S, hd, generator=gen), torch.randn(rows, KVH, S, hd, generator=gen)
    return cfg, cos, sin, qkv, caches


def naive_one_token_attention(qkv, k_cache, v_cache, pos, cfg):  # type: ignore[no-untyped-def]
    """float64, from the architecture description: each row's query and new key rotated at its position, the new
    key and value written there, the query attending to positions 0..pos; out [B, H * hd] and the caches after."""
    H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    k_ref, v_ref = k_cache.double(), v_cache.double()
    out = torch.empty(qkv.shape[0], H * hd, dtype=torch.float64)
    for b, p in enumerate(pos.tolist()):
        q, k, v = qkv[b].double().split((H * hd, KVH * hd, KVH * hd))
        q, k = _rope(q.view(1, H, hd), [p], cfg)[0], _rope(k.view(1, KVH, hd), [p], cfg)[0]
        k_ref[b, :, p], v_ref[b, :, p] = k, v.view(KVH, hd)
        for h in range(H):
            keys, values = k_ref[b, h // (H // KVH), : p + 1], v_ref[b, h // (H // KVH), : p + 1]
            out[b, h * hd : (h + 1) * hd] = torch.softmax(keys @ q[h] / hd**0.5, dim=0) @ values
    return out, k_ref, v_ref


@pytest.mark.parametrize("split", [(1, 128, 4), (1, 32, 1), (2, 32, 2), (4, 64, 4), (8, 16, 1), (16, 32, 1)],
                         ids=lambda t: "x".join(map(str, t)))  # fmt: skip
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_one_token_rope_attention_matches_float64_with_live_splits(pairing: str, split: tuple[int, int, int]) -> None:
    """(splits, keys per block, warps) against the float64 reference, positions from an empty cache through one
    block to several, so rows have one to all of their splits live; the split states poisoned first (a merge must
    read only its live splits' rows); run twice, so the merge must have reset its arrival counts."""
    B, H, KVH, hd = 6, 4, 2, 16
    cfg, cos, sin, qkv, caches = one_token_problem(pairing, B)
    pos = torch.tensor([0, 7, 64, 65, 260, 299])
    ref, k_ref, v_ref = naive_one_token_attention(qkv, *caches, pos, cfg)
    splits = split[0]
    policy = interpreter_policy(rope_attention_tiles={(B, H, hd): split})
    if splits > 1:
        cuda_ops._split_scratch(qkv.device, B * H, splits, hd)[0].fill_(float("nan"))
    ops = cuda_ops.CudaKernels(policy)  # type: ignore[arg-type]
    k_cache, v_cache = (c.clone() for c in caches)
    interleaved = pairing == "interleaved"
    out = ops.rope_attention(qkv, OneTokenAttention(k_cache, v_cache, pos, cos, sin, H, KVH, hd, interleaved))
    assert frob_rel_error(out, ref) <= 1e-6
    assert frob_rel_error(k_cache, k_ref) <= 1e-7 and torch.equal(v_cache.double(), v_ref)
    assert torch.equal(
        ops.rope_attention(qkv, OneTokenAttention(k_cache, v_cache, pos, cos, sin, H, KVH, hd, interleaved)), out
    )
    if splits > 1:
        assert not bool(cuda_ops._split_scratch(qkv.device, B * H, splits, hd)[1].any())


@pytest.mark.parametrize(("dtype", "rows"), BLOCKED_CASES)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_blocked_int4_gemv_matches_reference(dtype: torch.dtype, rows: int, group: int) -> None:
    """The blocked-layout kernels with every fusion, against the plain-layout weight's float64 product: the
    GEMV (1-4 rows) and the split-K tensor-core kernel (5, 16 rows; K split in two where it is 320);
    K = 5 or 10 blocks leaves a partial tile of blocks, N = 37 a partial tile of features."""
    gen = torch.Generator().manual_seed(rows + group)
    K, N = 384 if group == 128 else 320, 37
    raw = torch.randn(2 * N, K, generator=gen) / K**0.5
    plain = quantize_int4(raw, group)
    blocked = BlockedInt4Weight.from_int4(plain)
    dense = plain.dequantize(torch.float64)
    x = (3 * torch.randn(rows, K, generator=gen)).to(dtype)
    norm = 1 + 0.1 * torch.randn(K, generator=gen)
    bias = 0.1 * torch.randn(N, generator=gen)
    residual = torch.randn(rows, N, generator=gen).to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]  # norm gain rounded like the model
    cases = [
        (dict(), dict()),
        (dict(act=ops.ACT_SWIGLU, norm_weight=norm, eps=1e-6), dict(act=ops.ACT_SWIGLU, norm=norm)),
        (dict(bias=bias, residual=residual), dict(bias=bias, residual=residual)),
        (dict(act=ops.ACT_GELU, norm_weight=norm, eps=1e-6), dict(act=ops.ACT_GELU, norm=norm)),
        (dict(residual=residual), dict(residual=residual)),
        (dict(bias=bias), dict(bias=bias)),
    ]
    for kwargs, ref_kwargs in cases:
        swiglu = ref_kwargs.get("act") == ops.ACT_SWIGLU
        got = ops.fused_linear(x, blocked if swiglu else _rows(blocked, N), **kwargs)  # type: ignore[arg-type]
        ref = reference(x.double(), dense if swiglu else dense[:N], **ref_kwargs)
        assert got.dtype == dtype
        assert frob_rel_error(got, ref) <= tol, kwargs


@pytest.mark.parametrize("tile", [(4, 8, 2), (4, 16, 4), (8, 8, 4), (4, 32, 8), (4, 2, 1)])
def test_blocked_int4_gemv_tiles(tile: tuple[int, int, int]) -> None:
    """Every built-in one-row tile (BLOCK_N, blocks per tile, warps) on a shape that leaves partial tiles of
    blocks (K = 5 blocks) and of features (N = 37), with the norm, SwiGLU and residual fused; 2-block tiles
    run the prefetching loop three times."""
    gen = torch.Generator().manual_seed(sum(tile))
    K, N = 320, 37
    plain = quantize_int4(torch.randn(2 * N, K, generator=gen) / K**0.5, 64)
    blocked, dense = BlockedInt4Weight.from_int4(plain), plain.dequantize(torch.float64)
    x = 3 * torch.randn(1, K, generator=gen)
    norm = 1 + 0.1 * torch.randn(K, generator=gen)
    residual = torch.randn(1, N, generator=gen)
    ops = cuda_ops.CudaKernels(interpreter_policy(blocked_tiles={(N, K, 1): tile}))  # type: ignore[arg-type]
    assert ops.policy.blocked_tile(N, K, 1) == tile
    got = ops.fused_linear(x, blocked, act=ops.ACT_SWIGLU, norm_weight=norm, eps=1e-6)
    assert frob_rel_error(got, reference(x.double(), dense, act=ops.ACT_SWIGLU, norm=norm)) <= 1e-5
    got = ops.fused_linear(x, _rows(blocked, N), residual=residual)
    assert frob_rel_error(got, reference(x.double(), dense[:N], residual=residual)) <= 1e-5


def test_blocked_int4_prefill_paths_match_plain() -> None:
    """Many rows: the blocked weight dequantized for cuBLAS, and through the split-K kernel (cuBLAS switched
    off: two row tiles, the second partial), give the plain weight's results."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(POLICY.blocked_gemm_max_rows + 3, 256, generator=gen)
    cases = []
    for group in (32, 64):
        plain = quantize_int4(torch.randn(48, 256, generator=gen), group)
        blocked = BlockedInt4Weight.from_int4(plain)
        assert torch.equal(ops.dequantize_int4(blocked, torch.float32), plain.dequantize())
        cases.append((blocked, reference(x, plain.dequantize())))
    for blocked, ref in cases:
        assert frob_rel_error(ops.fused_linear(x, blocked), ref) <= 1e-5
    no_cublas = cuda_ops.CudaKernels(interpreter_policy(cublas_16bit=False))  # type: ignore[arg-type]
    for blocked, ref in cases:
        assert frob_rel_error(no_cublas.fused_linear(x, blocked), ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [5, 9])
def test_plain_and_dense_products_without_cublas(dtype: torch.dtype, rows: int) -> None:
    """cuBLAS switched off (TINYLOOP_DISABLE_CUBLAS_FP16): more rows than one GEMV takes run through it a few rows
    at a time, with the norm, bias, SwiGLU and residual fused, for plain INT4 and 16-bit weights."""
    gen = torch.Generator().manual_seed(rows)
    K, N = 128, 40
    raw = torch.randn(2 * N, K, generator=gen) / K**0.5
    norm = 1 + 0.1 * torch.randn(K, generator=gen)
    bias, residual = 0.1 * torch.randn(N, generator=gen), torch.randn(rows, N, generator=gen).to(dtype)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    no_cublas = cuda_ops.CudaKernels(interpreter_policy(cublas_16bit=False))  # type: ignore[arg-type]
    for weight in (quantize_int4(raw, 32), raw.to(dtype)):
        dense = weight.dequantize() if isinstance(weight, Int4Weight) else weight.float()
        got = no_cublas.fused_linear(x, weight, act=ops.ACT_SWIGLU, norm_weight=norm, eps=1e-6)
        assert frob_rel_error(got, reference(x.double(), dense, act=ops.ACT_SWIGLU, norm=norm)) <= TOL[dtype]
        got = no_cublas.fused_linear(x, _rows(weight, N), bias=bias, residual=residual)
        ref = reference(x.double(), dense[:N], bias=bias, residual=residual)
        assert got.dtype == dtype and frob_rel_error(got, ref) <= TOL[dtype]


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_fused_linear_into_residual(rows: int) -> None:
    """into_residual writes the same result into the residual's storage on every path (GEMV, split-K,
    dequantize + cuBLAS)."""
    gen = torch.Generator().manual_seed(rows)
    K, N = 320, 37
    blocked = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(N, K, generator=gen) / K**0.5, 64))
    x, residual = torch.randn(rows, K, generator=gen), torch.randn(rows, N, generator=gen)
    want = ops.fused_linear(x, blocked, residual=residual)
    target = residual.clone()
    got = ops.fused_linear(x, blocked, residual=target, into_residual=True)
    assert got.data_ptr() == target.data_ptr()
    assert frob_rel_error(got, want.double()) <= 1e-6


class CpuStandInTinygemm(CudaTinygemmWeight):
    """The CUDA tinygemm weight's path through the launchers, run on the CPU: torch's CPU tinygemm kernel takes the
    same scales and zeros ((q - 8) * scale + zero) in its own packed layout."""

    @classmethod
    def of(cls, w: Int4Weight) -> CpuStandInTinygemm:
        packed = torch._convert_weight_to_int4pack_for_cpu(w.codes(w.packed).to(torch.int32), 1)
        return cls(packed, tinygemm_scales_zeros(w), w.group_size, *w.shape)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)


@pytest.mark.parametrize("rows", [2, 8])
def test_tinygemm_products_take_the_unfused_epilogues(rows: int) -> None:
    """A tinygemm weight's product with the norm before it and bias, SwiGLU, GELU and residual after it (also
    into the residual's storage), against float64 with the weights tinygemm computes with: (q - 8) * scale + zero
    from bfloat16 scales and zeros (zero = minimum + 8 * scale)."""
    gen = torch.Generator().manual_seed(rows)
    K, N = 256, 48
    int4 = quantize_int4(torch.randn(2 * N, K, generator=gen) / K**0.5, 64)
    scales_zeros = tinygemm_scales_zeros(int4).double()  # [K / G, 2N, 2]
    codes = int4.codes(int4.packed).double()
    scale, zero = (scales_zeros[..., i].t().repeat_interleave(64, dim=1) for i in (0, 1))
    dense = (codes - 8) * scale + zero
    assert frob_rel_error(dense, int4.dequantize().double()) <= 1e-2  # bfloat16 scales and zeros
    upper = Int4Weight(int4.packed[:N].contiguous(), int4.scale[:N].contiguous(), int4.minimum[:N].contiguous(), 64)
    whole, half = CpuStandInTinygemm.of(int4), CpuStandInTinygemm.of(upper)
    x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
    norm = 1 + 0.3 * torch.randn(K, generator=gen)
    bias = 0.1 * torch.randn(N, generator=gen)
    residual = torch.randn(rows, N, generator=gen).to(torch.bfloat16)
    # The norm runs as its own launch before the product (its kernel: test_rms_norm_modes); in bfloat16,
    # Triton's interpreter rounds its output toward zero (0.8 % low here), so the reference starts from it.
    normed = ops.rms_norm(x, norm, 1e-6)
    cases = [
        (whole, dict(act=ops.ACT_SWIGLU, norm_weight=norm, eps=1e-6), normed, dict(act=ops.ACT_SWIGLU)),
        (whole, dict(act=ops.ACT_GELU), x, dict(act=ops.ACT_GELU)),
        (half, dict(norm_weight=norm, eps=1e-6), normed, dict()),
        (half, dict(bias=bias), x, dict(bias=bias)),
        (half, dict(residual=residual), x, dict(residual=residual)),
        (half, dict(bias=bias, residual=residual), x, dict(bias=bias, residual=residual)),
    ]
    for w, kwargs, ref_x, ref_kwargs in cases:
        got = ops.fused_linear(x, w, **kwargs)  # type: ignore[arg-type]
        ref = reference(ref_x.double(), dense if w is whole else dense[:N], **ref_kwargs)
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert frob_rel_error(got, ref) <= 1e-2, kwargs
    target = residual.clone()
    got = ops.fused_linear(x, half, residual=target, into_residual=True)
    assert got.data_ptr() == target.data_ptr()
    assert torch.equal(got, ops.fused_linear(x, half, residual=residual))


def test_gemv_register_cap_keeps_results() -> None:
    """KernelPolicy.gemv_max_registers only passes ptxas a register cap: the same product, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    w = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(37, 320, generator=gen), 64))
    x, norm = torch.randn(2, 320, generator=gen), 1 + 0.1 * torch.randn(320, generator=gen)
    want = ops.fused_linear(x, w, norm_weight=norm, eps=1e-6)
    capped = cuda_ops.CudaKernels(interpreter_policy(gemv_max_registers=80))  # type: ignore[arg-type]
    assert torch.equal(capped.fused_linear(x, w, norm_weight=norm, eps=1e-6), want)


def test_dequantize_int4_is_exact() -> None:
    raw = torch.randn(24, 256, generator=torch.Generator().manual_seed(1))
    q = quantize_int4(raw, 64)
    assert torch.equal(ops.dequantize_int4(q, torch.float32), q.dequantize())


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_rms_norm_modes(mode: int) -> None:
    gen = torch.Generator().manual_seed(mode)
    x, r = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    w = 1 + 0.1 * torch.randn(48, generator=gen)
    inp = x.double() + r.double() if mode == 2 else x.double()
    ref = inp * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    if mode == 1:
        ref = ref + r.double()
    assert frob_rel_error(ops.rms_norm(x, w, 1e-6, r, mode), ref) <= 1e-6


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("T", [3, 19])  # one partial block of rows; blocks of POLICY.rope_block_rows and a partial one
def test_rope_store_and_cached_attention(pairing: str, T: int) -> None:
    B, H, KVH, hd, S = 2, 4, 2, 16, 40
    gen = torch.Generator().manual_seed(3)
    cfg = ArchConfig(
        vocab_size=64, d_model=64, n_heads=H, n_kv_heads=KVH, head_dim=hd, ffn_dim=64,
        n_prelude=0, n_body=1, n_coda=0, rope_pairing=pairing,
    )  # fmt: skip
    cos, sin = rope_tables(cfg, 64, "cpu")
    qkv = torch.randn(B * T, (H + 2 * KVH) * hd, generator=gen)
    k_cache, v_cache = torch.randn(B, KVH, S, hd, generator=gen), torch.randn(B, KVH, S, hd, generator=gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pos = (torch.tensor([5, 9])[:, None] + torch.arange(T)).reshape(-1)

    q = ops.rope_store(qkv, k_cache, v_cache, pos, cos, sin, H, KVH, hd, T, pairing == "interleaved")

    pos2 = pos.view(B, T)
    qr, kr, vr = qkv.view(B, T, -1).split((H * hd, KVH * hd, KVH * hd), -1)
    q_ref = apply_rope(qr.reshape(B, T, H, hd), cos[pos2], sin[pos2], pairing)
    k_new = apply_rope(kr.reshape(B, T, KVH, hd), cos[pos2], sin[pos2], pairing)
    for b in range(B):
        for t in range(T):
            k_ref[b, :, pos2[b, t]] = k_new[b, t]
            v_ref[b, :, pos2[b, t]] = vr[b, t].view(KVH, hd)
    assert torch.allclose(q.view(B, T, H, hd), q_ref, atol=1e-6)
    assert torch.allclose(k_cache, k_ref, atol=1e-6) and torch.equal(v_cache, v_ref)

    out = ops.cached_attention(q, k_cache, v_cache, pos, T)
    ref = torch.empty(B * T, H * hd, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            p = int(pos2[b, t])
            for h in range(H):
                keys, values = k_ref[b, h // (H // KVH), : p + 1].double(), v_ref[b, h // (H // KVH), : p + 1].double()
                probs = torch.softmax(keys @ q_ref[b, t, h].double() * hd**-0.5, dim=0)
                ref[b * T + t, h * hd : (h + 1) * hd] = probs @ values
    assert frob_rel_error(out, ref) <= 1e-6


@pytest.mark.parametrize(
    ("tile", "split"),
    [((128, 4), None), ((256, 8), None), ((128, 4), (4, 64, 4)), ((128, 4), (2, 32, 2))],
    ids=["whole-128", "whole-256", "4-splits", "2-splits"],
)  # a split brings its own tile
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_one_token_rope_attention_equals_two_kernels(
    pairing: str, tile: tuple[int, int], split: tuple[int, int, int] | None
) -> None:
    """Both attention tiles (keys per block, warps), positions past one block of either; split along the
    keys (positions 0 and 7 leave splits empty), twice, so the arrival counts must have been reset."""
    B, H, KVH, hd = 3, 4, 2, 16
    policy = interpreter_policy(
        narrow_head_attention_tile=tile, rope_attention_tiles={(B, H, hd): split} if split else {}
    )
    ops = cuda_ops.CudaKernels(policy)  # type: ignore[arg-type]
    _, cos, sin, qkv, (k_cache, v_cache) = one_token_problem(pairing, B)
    k2, v2 = k_cache.clone(), v_cache.clone()
    pos = torch.tensor([0, 7, 260])
    out = ops.rope_attention(
        qkv, OneTokenAttention(k_cache, v_cache, pos, cos, sin, H, KVH, hd, pairing == "interleaved")
    )
    q = ops.rope_store(qkv, k2, v2, pos, cos, sin, H, KVH, hd, 1, pairing == "interleaved")
    ref = ops.cached_attention(q, k2, v2, pos, 1)
    assert torch.allclose(k_cache, k2, atol=1e-6) and torch.equal(v_cache, v2)
    assert frob_rel_error(out, ref.double()) <= 1e-6
    again = ops.rope_attention(
        qkv, OneTokenAttention(k_cache, v_cache, pos, cos, sin, H, KVH, hd, pairing == "interleaved")
    )
    assert torch.equal(again, out)
    if split is not None:
        counts = cuda_ops._split_scratch(qkv.device, B * H, split[0], hd)[1]
        assert not bool(counts.any())


@pytest.mark.parametrize(("group", "tile"), [(32, (64, 32, 4)), (64, (16, 16, 1)), (128, (128, 64, 4))])
@pytest.mark.parametrize("residual", [False, True], ids=["alone", "residual"])
def test_attention_out_matches_float64_and_the_two_launches(group: int, tile: tuple[int, int, int], residual: bool):
    """One-token attention fused with the INT4 output projection (tiles: keys per block, output rows, warps; 80
    output rows leave a partial tile), heads of 64 over 1-2 blocks of the blocked layout, positions from an
    empty cache to several blocks of keys: against float64 and against rope_attention then the blocked GEMV,
    the caches written alike; the partial products poisoned first; twice, so the arrival counts were reset."""
    from tinyloop.kernels import attention_out

    B, H, KVH, hd, N = 3, 4, 2, 64, 80
    cfg, cos, sin, qkv, caches = one_token_problem("half", B, hd)
    pos = torch.tensor([0, 7, 260])
    gen = torch.Generator().manual_seed(group)
    plain = quantize_int4(torch.randn(N, H * hd, generator=gen) / (H * hd) ** 0.5, group)
    weight = BlockedInt4Weight.from_int4(plain)
    res = torch.randn(B, N, generator=gen) if residual else None
    heads64, k_ref, v_ref = naive_one_token_attention(qkv, *caches, pos, cfg)
    ref = heads64 @ plain.dequantize(torch.float64).T + (0 if res is None else res.double())
    policy = interpreter_policy(attention_out_max_rows=B, attention_out_tile=tile)
    ops = cuda_ops.CudaKernels(policy)  # type: ignore[arg-type]
    k_cache, v_cache = (c.clone() for c in caches)
    attn = OneTokenAttention(k_cache, v_cache, pos, cos, sin, H, KVH, hd, False)
    assert ops.attention_out_applies(B, attn, weight, False)
    assert not ops.attention_out_applies(B, attn, weight, True)  # long caches keep the split attention
    assert not ops.attention_out_applies(B + 1, attn, weight, False)
    assert not ops.attention_out_applies(B, attn, plain, False)
    tiles = -(-N // tile[1])
    attention_out._scratch(qkv.device, B, H, tiles, hd, tile[1])[1].fill_(float("nan"))
    out = ops.attention_out(qkv, attn, weight, res)
    assert frob_rel_error(out, ref) <= 1e-6
    assert frob_rel_error(k_cache, k_ref) <= 1e-7 and torch.equal(v_cache.double(), v_ref)
    k2, v2 = (c.clone() for c in caches)
    heads = ops.rope_attention(qkv, OneTokenAttention(k2, v2, pos, cos, sin, H, KVH, hd, False))
    two_launches = ops.fused_linear(heads, weight, **({} if res is None else {"residual": res}))
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    assert frob_rel_error(out, two_launches) <= 1e-6
    assert torch.equal(ops.attention_out(qkv, attn, weight, res), out)
    assert not bool(attention_out._scratch(qkv.device, B, H, tiles, hd, tile[1])[2].any())


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("blocked", [False, True], ids=["plain", "blocked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_embedding_rows_match_a_float64_dequantization(group: int, blocked: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(group)
    V, D = 37, 384  # D under one 512-column program: a masked tail
    q = quantize_int4(torch.randn(V, D, generator=gen), group)
    table = BlockedInt4Weight.from_int4(q) if blocked else q
    ids = torch.tensor([[3, 36, 0], [3, 17, 5]])
    got = ops.int4_rows(ids, table, dtype)
    codes = torch.stack((q.packed & 0x0F, q.packed >> 4), dim=-1).flatten(-2).double()  # plain column order
    ref = codes.view(V, D // group, group) * q.scale.double()[..., None] + q.minimum.double()[..., None]
    ref = ref.view(V, D)[ids]
    assert got.shape == (2, 3, D) and got.dtype == dtype
    assert frob_rel_error(got, ref) <= (1e-7 if dtype == torch.float32 else 1e-3)
    assert torch.equal(got, table.rows(ids, dtype))  # the same rounding as the torch path
    assert ops.int4_rows(torch.zeros(0, dtype=torch.long), table, dtype).shape == (0, D)


def test_narrow_heads_are_not_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads narrower than the policy's split_attention_min_head_dim run whole (no split scratch), with the same
    result."""
    B, H, hd, S = 2, 2, 16, 40
    gen = torch.Generator().manual_seed(6)
    cfg = ArchConfig(vocab_size=64, d_model=32, n_heads=H, n_kv_heads=H, head_dim=hd, ffn_dim=64, n_prelude=0, n_body=1,
                     n_coda=0)  # fmt: skip
    cos, sin = rope_tables(cfg, S, "cpu")
    qkv = torch.randn(B, 3 * H * hd, generator=gen)
    caches = torch.randn(B, H, S, hd, generator=gen), torch.randn(B, H, S, hd, generator=gen)
    pos = torch.tensor([5, 33])
    whole = cuda_ops.CudaKernels(interpreter_policy(rope_attention_tiles={(B, H, hd): (1, 128, 4)})).rope_attention(  # type: ignore[arg-type]
        qkv, OneTokenAttention(*(c.clone() for c in caches), pos, cos, sin, H, H, hd, False)
    )

    def no_scratch(*args: object) -> None:
        raise AssertionError("a narrow head was split")

    monkeypatch.setattr(cuda_ops, "_split_scratch", no_scratch)
    assert POLICY.rope_attention_tile(B, H, 128)[0] > 1 and hd < POLICY.split_attention_min_head_dim
    assert torch.equal(
        ops.rope_attention(qkv, OneTokenAttention(*(c.clone() for c in caches), pos, cos, sin, H, H, hd, False)), whole
    )
