"""Launchers for the Triton kernels: shapes, launch configurations and the choice of kernel per size.

Every launcher takes the engine's `KernelPolicy` (kernels/policy.py) first, and plain tensors (CUDA tensors,
or CPU tensors under TRITON_INTERPRET=1, which is how the CPU test suite checks the kernels).
`CudaKernels` binds them to one policy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton

from tinyloop.kernels import attention_out, gluon_int4_mma, persistent_mlp
from tinyloop.kernels.dispatch import Weight
from tinyloop.kernels.one_token import OneTokenAttention
from tinyloop.kernels.policy import ACT_GELU, ACT_NONE, ACT_SWIGLU, KernelPolicy
from tinyloop.kernels.triton_attention import _cached_attention_kernel, _rope_attention_kernel, _rope_store_kernel
from tinyloop.kernels.triton_elementwise import _add_kernel, _swiglu_kernel
from tinyloop.kernels.triton_embedding import _int4_rows_kernel
from tinyloop.kernels.triton_matmul import (
    _dequant_kernel,
    _gemv_blocked_int4_kernel,
    _matvec_kernel,
    _splitk_blocked_int4_kernel,
    _splitk_epilogue_kernel,
)
from tinyloop.kernels.triton_norm import _rms_norm_kernel
from tinyloop.log import info
from tinyloop.quant import BlockedInt4Weight, CudaMmaInt4Weight, CudaTinygemmWeight, Int4Weight

__all__ = ["ACT_GELU", "ACT_NONE", "ACT_SWIGLU", "CudaKernels", "KernelPolicy", "ProductWeight"]

# What a product multiplies: a model weight, or a decoder's tinygemm repack of an INT4 one.
# What cuBLAS-sized (unfused) products multiply, and what any product may.
UnfusedWeight = Weight | CudaTinygemmWeight
ProductWeight = UnfusedWeight | CudaMmaInt4Weight

# Gluon kernels that failed to compile with the installed Triton ("gluon", "staged"): a fact about this
# process's Triton, recorded once so that later launches go straight to the Triton kernel.
_UNBUILDABLE: set[str] = set()


@dataclass(frozen=True)
class _Epilogue:
    """What a fused product does around its multiply and where it writes: x's rms norm with `norm_weight`,
    `bias`, the activation and the `residual` sum, into `out`. An absent tensor is `out` (a valid pointer the
    kernel does not read); `flags` holds the kernels' NORM, BIAS, ACT and RESIDUAL switches."""

    out: torch.Tensor
    residual: torch.Tensor
    norm_weight: torch.Tensor
    bias: torch.Tensor
    eps: float
    flags: dict[str, Any]

    def rows(self, start: int, stop: int) -> _Epilogue:
        """This epilogue for rows start..stop of x (the output's and the residual's rows)."""
        out = self.out[start:stop]
        residual = self.residual[start:stop] if self.flags["RESIDUAL"] else out
        norm_weight = self.norm_weight if self.flags["NORM"] else out
        bias = self.bias if self.flags["BIAS"] else out
        return _Epilogue(out, residual, norm_weight, bias, self.eps, self.flags)


def _gemv_gluon(policy: KernelPolicy, x: torch.Tensor, w: BlockedInt4Weight, ep: _Epilogue) -> bool:
    """Launches the Gluon GEMV; False (once, after saying why) where this Triton's Gluon cannot build it."""
    from triton.compiler.errors import CompilationError

    from tinyloop.kernels.gluon_gemv import PRMT_HIGH_BYTE, _gemv_int4_gluon_kernel

    out, res, nw, b, eps, flags = ep.out, ep.residual, ep.norm_weight, ep.bias, ep.eps, ep.flags
    (M, K), N = x.shape, out.shape[1]
    rows, lanes_rows, per_thread, warps_rows, warps_blocks = policy.gluon_tile(N, K, flags["ACT"], M)
    block_n = rows * lanes_rows * warps_rows
    blocks = per_thread * (16 // lanes_rows) * warps_blocks
    even = N % block_n == 0 and (K // 64) % blocks == 0
    try:
        _gemv_int4_gluon_kernel[(triton.cdiv(N, block_n),)](
            x, w.packed.view(torch.int32), w.scale, w.minimum, out, res, nw, b, N, K, eps, K // 8, K // 64,
            x.stride(0), out.stride(0), res.stride(0), PRMT_HIGH_BYTE, M=M, NORM=flags["NORM"], BIAS=flags["BIAS"],
            ACT=flags["ACT"], RESIDUAL=flags["RESIDUAL"], R=rows, LR=lanes_rows, BPT=per_thread, WR=warps_rows,
            WB=warps_blocks, EVEN=even,
            num_warps=warps_rows * warps_blocks, **policy.register_cap(),
            **policy.gluon_pdl_options(policy.gluon_launch_dependents),
        )  # fmt: skip
    except CompilationError as exc:
        _UNBUILDABLE.add("gluon")
        info(f"the Gluon decode GEMV does not build with Triton {triton.__version__} ({exc}); using the Triton one")
        return False
    return True


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _gemv_staged(policy: KernelPolicy, x: torch.Tensor, w: BlockedInt4Weight, ep: _Epilogue) -> bool:
    """Launches the staged GEMV; False where its plan does not apply (or, once, where it does not build)."""
    from triton.compiler.errors import CompilationError
    from triton.experimental.gluon.language import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tinyloop.kernels.gluon_gemv import PRMT_HIGH_BYTE
    from tinyloop.kernels.gluon_gemv_staged import (
        CHUNK_BLOCKS,
        TILE_ROWS,
        _gemv_int4_staged_kernel,
        staged_plan,
    )

    out, res, nw, b, eps, flags = ep.out, ep.residual, ep.norm_weight, ep.bias, ep.eps, ep.flags
    N, K = out.shape[1], x.shape[1]
    if not policy.staged_applies(N, K, flags["ACT"]):
        return False
    words = w.packed.view(torch.int32)
    aligned = all(t.data_ptr() % 16 == 0 for t in (words, w.scale, w.minimum))
    if not (aligned and words.is_contiguous() and w.scale.is_contiguous() and w.minimum.is_contiguous()):
        return False
    plan = staged_plan(N, K, flags["ACT"], _sm_count(x.device.index or 0), w.scale.element_size())
    if plan is None:
        return False
    rows, blocks = words.shape[0], K // 64
    word_layout = NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    group_layout = NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * w.scale.element_size(), rank=2)
    w_desc = TensorDescriptor(words, [rows, blocks, 8], [blocks * 8, 8, 1], [TILE_ROWS, CHUNK_BLOCKS, 8], word_layout)
    s_desc, m_desc = (TensorDescriptor(t, [rows, blocks], [blocks, 1], [TILE_ROWS, CHUNK_BLOCKS], group_layout)
                      for t in (w.scale, w.minimum))  # fmt: skip
    rows_per_thread, warps, register_cap = policy.staged_layout
    try:
        _gemv_int4_staged_kernel[(plan.programs,)](
            x, w_desc, s_desc, m_desc, out, res, nw, b, N, K, eps, PRMT_HIGH_BYTE,
            R=rows_per_thread, WR=warps, num_warps=warps,
            NORM=flags["NORM"], BIAS=flags["BIAS"], ACT=flags["ACT"], RESIDUAL=flags["RESIDUAL"],
            TILES=plan.tiles, KCH=plan.chunks, **policy.gluon_pdl_options(policy.staged_launch_dependents),
            **({"maxnreg": register_cap} if register_cap else {}),
        )  # fmt: skip
    except CompilationError as exc:
        _UNBUILDABLE.add("staged")
        info(f"the staged decode GEMV does not build with Triton {triton.__version__} ({exc}); not using it")
        return False
    return True


def _gemv_gluon_rows(policy: KernelPolicy, x: torch.Tensor, w: BlockedInt4Weight, ep: _Epilogue) -> bool:
    """One row: the staged GEMV where it is on and its plan applies; else (and for a few rows) the plain Gluon
    one where it is on. False: neither ran (the Triton kernels then do)."""
    one_row = x.shape[0] == 1
    if one_row and policy.staged_gemv and "staged" not in _UNBUILDABLE and _gemv_staged(policy, x, w, ep):
        return True
    return policy.gluon_gemv and "gluon" not in _UNBUILDABLE and _gemv_gluon(policy, x, w, ep)


def _gluon_applies(policy: KernelPolicy, x: torch.Tensor, w: BlockedInt4Weight, M: int) -> bool:
    """What the Gluon GEMVs are written for: up to `gluon_gemv_max_rows` rows (the staged one: one), 64-column
    groups, on CUDA."""
    return M <= policy.gluon_gemv_max_rows and w.group_size == 64 and x.shape[1] % 64 == 0 and x.is_cuda


def _weight_parts(w: Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    if isinstance(w, Int4Weight):
        words = w.packed.view(torch.int32)  # plain or blocked: the kernels are told which
        return words, w.scale, w.minimum, w.group_size, True
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"the CUDA kernels take INT4 or 16-bit weights, got {type(w).__name__}")
    return w, w, w, 64, False


def _block_width(w: Weight) -> int:
    """The blocked INT4 layout's block width for `_load_w`, or 0 for the plain layout."""
    return w.block if isinstance(w, BlockedInt4Weight) else 0


def fused_linear(
    policy: KernelPolicy,
    x: torch.Tensor,
    w: ProductWeight,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    act: int = ACT_NONE,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    into_residual: bool = False,
) -> torch.Tensor:
    """act(rmsnorm(x) @ w.T + bias) + residual for x [M, K] (row-contiguous), in one kernel where it pays.

    With act=ACT_SWIGLU the weight holds [gate; up] rows and the result has half as many features.
    into_residual: the result overwrites `residual` (which the caller no longer needs), which spares cuBLAS
    the copy of the residual into a fresh output.
    """
    M, K = x.shape
    n_total = w.shape[0]
    N = n_total // 2 if act == ACT_SWIGLU else n_total
    if x.stride(1) != 1:
        x = x.contiguous()
    dtype = out_dtype or x.dtype
    if into_residual and residual is not None and residual.dtype == dtype and residual.is_contiguous():
        out = residual
    else:
        out = torch.empty((M, N), dtype=dtype, device=x.device)
    if isinstance(w, CudaTinygemmWeight):
        return _linear_unfused(policy, x, w, norm_weight, eps, bias, act, residual, out)
    res = residual if residual is not None else out
    nw = norm_weight if norm_weight is not None else out
    b = bias if bias is not None else out
    epilogue = dict(NORM=norm_weight is not None, BIAS=bias is not None, ACT=act, RESIDUAL=residual is not None)
    ep = _Epilogue(out, res, nw, b, eps, epilogue)
    if isinstance(w, CudaMmaInt4Weight):
        return _mma_int4_linear(policy, x, w, ep)
    if isinstance(w, BlockedInt4Weight):
        on_cublas = policy.int4_rows_on_cublas(M)
    else:
        on_cublas = policy.rows_on_cublas(
            M, policy.matvec_max_rows if isinstance(w, Int4Weight) else policy.matvec_16bit_max_rows
        )
    if on_cublas:
        return _linear_unfused(policy, x, w, norm_weight, eps, bias, act, residual, out)
    words, scale, minimum, group, is_int4 = _weight_parts(w)
    flags = dict(GROUP=group, INT4=is_int4, **epilogue)
    if isinstance(w, BlockedInt4Weight):
        del flags["INT4"]
        if _gluon_applies(policy, x, w, M) and _gemv_gluon_rows(policy, x, w, ep):
            return out
        if M <= policy.matvec_max_rows:
            args = (x, words, scale, minimum, out, res, nw, b, M, N, K, eps, x.stride(0), out.stride(0), res.stride(0))
            block_n, block_b, warps = policy.blocked_tile(N, K, M)
            _gemv_blocked_int4_kernel[(triton.cdiv(N, block_n),)](
                *args, K // 8, K // group, **flags, BLOCK=w.block, ROWS=triton.next_power_of_2(M), BLOCK_N=block_n,
                BLOCK_B=block_b, num_warps=warps, **policy.register_cap(), **policy.pdl_options(),
            )  # fmt: skip
            return out
        return _splitk_linear(policy, x, w, ep)
    # Plain-layout or 16-bit weights: the GEMV over up to matvec_max_rows rows at a time (more rows only
    # with cuBLAS switched off).
    for r0 in range(0, M, policy.matvec_max_rows):
        r1 = min(M, r0 + policy.matvec_max_rows)
        xs, outs, ress = x[r0:r1], out[r0:r1], res if residual is None else res[r0:r1]
        # batch invariant: one kernel shape whatever the row count, so a row's sums keep their order
        launch_rows = policy.matvec_max_rows if policy.batch_invariant else r1 - r0
        block_n, block_k, warps = policy.matvec_tile(N, K, launch_rows, group)
        _matvec_kernel[(triton.cdiv(N, block_n),)](
            xs, words, scale, minimum, outs, ress, nw, b, r1 - r0, N, K, eps, xs.stride(0), outs.stride(0),
            ress.stride(0), **flags, ROWS=triton.next_power_of_2(launch_rows), BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps,
        )  # fmt: skip
    return out


def _splitk_linear(policy: KernelPolicy, x: torch.Tensor, w: BlockedInt4Weight, ep: _Epilogue) -> torch.Tensor:
    """Float32 partial products over K splits (`_splitk_blocked_int4_kernel`), `_splitk_epilogue_kernel` to
    finish."""
    M, K = x.shape
    n_total, N = w.shape[0], ep.out.shape[1]
    block_n, block_m, block_k, warps = policy.splitk_tile(N, K, M)
    block_k = max(block_k, w.group_size)
    n_tiles, m_tiles, k_tiles = triton.cdiv(n_total, block_n), triton.cdiv(M, block_m), triton.cdiv(K, block_k)
    splits, tiles_per_split = _k_splits(policy.splitk_programs, k_tiles, n_tiles * m_tiles)
    part = torch.empty((splits, M, n_total), dtype=torch.float32, device=x.device)
    words = w.packed.view(torch.int32)
    args = (x, words, w.scale, w.minimum, ep.norm_weight, part, M, n_total, K, tiles_per_split * block_k,
            x.stride(0), K // 8, K // w.group_size)  # fmt: skip
    _splitk_blocked_int4_kernel[(n_tiles, splits, m_tiles)](
        *args, GROUP=w.group_size, BLOCK=w.block, NORM=ep.flags["NORM"], IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **policy.pdl_options(),
    )  # fmt: skip
    return _sum_splits(policy, x, part, ep)


def _k_splits(programs: int, k_tiles: int, programs_per_split: int, max_splits: int | None = None) -> tuple[int, int]:
    """(splits, K tiles per split) of a split-K product: K is split until about `programs` programs run (into at
    most `max_splits`), and no split is empty."""
    wanted = min(k_tiles, max_splits or k_tiles, max(1, programs // programs_per_split))
    tiles_per_split = triton.cdiv(k_tiles, wanted)
    return triton.cdiv(k_tiles, tiles_per_split), tiles_per_split


def _sum_splits(policy: KernelPolicy, x: torch.Tensor, part: torch.Tensor, ep: _Epilogue) -> torch.Tensor:
    """`_splitk_epilogue_kernel` over float32 partial products part[split, rows, features]: their sum, times
    1 / rms(x) with NORM, then bias, activation and residual, into `out`."""
    out, res, b, eps, flags = ep.out, ep.residual, ep.bias, ep.eps, ep.flags
    splits, M = part.shape[0], x.shape[0]
    N, K = out.shape[1], x.shape[1]
    block = min(1024, triton.next_power_of_2(N))
    _splitk_epilogue_kernel[(M, triton.cdiv(N, block))](
        x, part, out, res, b, M, N, K, splits, eps, x.stride(0), out.stride(0), res.stride(0), NORM=flags["NORM"],
        BIAS=flags["BIAS"], ACT=flags["ACT"], RESIDUAL=flags["RESIDUAL"], BLOCK=block, num_warps=4,
        **policy.pdl_options(),
    )  # fmt: skip
    return out


def mma_int4_applies(policy: KernelPolicy, w: CudaMmaInt4Weight | Int4Weight, rows: int) -> bool:
    """Whether the tensor-core INT4 kernel's tile for `rows` rows divides w (out by its weight rows, each half
    of it for a [gate; up] matrix, in by its columns per step, and its columns per step by the INT4 groups)."""
    n, k = w.shape
    warps, row_tiles, block_k, _ = policy.mma_int4_tile(n, k, rows)
    return n % (32 * warps * row_tiles) == 0 and k % block_k == 0 and block_k % w.group_size == 0


def mma_int4_splits(policy: KernelPolicy, k_tiles: int, n_tiles: int, m_tiles: int, rows_x: int) -> tuple[int, int]:
    """(K splits, K tiles per split) of a tensor-core INT4 product of n_tiles x m_tiles output tiles: K split until
    about the policy's programs run, the warpgroup version's splits capped by the partials' bytes; batch invariant,
    by the matrix alone (the same splits at every row count: each row summed in one order)."""
    wgmma = policy.mma_int4_wgmma
    programs = policy.mma_int4_wgmma_programs if wgmma else policy.mma_int4_programs
    if policy.batch_invariant:
        return _k_splits(programs, k_tiles, n_tiles, policy.batch_invariant_max_splits or None)
    max_splits = max(1, policy.mma_int4_wgmma_split_rows // (rows_x * m_tiles)) if wgmma else None
    return _k_splits(programs, k_tiles, n_tiles * m_tiles, max_splits)


def _mma_int4_linear(policy: KernelPolicy, x: torch.Tensor, w: CudaMmaInt4Weight, ep: _Epilogue) -> torch.Tensor:
    """One launch of `gluon_int4_mma`: float32 partial products over K splits on tensor cores, each output tile
    finished (split sum and epilogue) by its last program."""
    if x.dtype != w.dtype:
        raise ValueError(f"the tensor-core INT4 copy was made for {w.dtype} compute, got {x.dtype} rows")
    out, res, nw, b, eps, flags = ep.out, ep.residual, ep.norm_weight, ep.bias, ep.eps, ep.flags
    M, K = x.shape
    n_total = w.shape[0]
    warps, row_tiles, block_k, rows_x = policy.mma_int4_tile(n_total, K, M)
    block_n = 16 * warps * row_tiles
    if not mma_int4_applies(policy, w, M):
        raise ValueError(f"the tensor-core INT4 tile ({block_n} rows x {block_k} columns) does not divide {w.shape}")
    n_tiles, m_tiles = n_total // block_n, triton.cdiv(M, rows_x)
    counted_rows = w.arrivals.numel() // n_tiles * rows_x
    if M > counted_rows and policy.batch_invariant:  # a long prompt chunk: row blocks, each split alike
        for r0 in range(0, M, counted_rows):
            _mma_int4_linear(policy, x[r0 : r0 + counted_rows], w, ep.rows(r0, r0 + counted_rows))
        return ep.out
    if n_tiles * m_tiles > w.arrivals.numel():
        raise ValueError(f"{m_tiles} tiles of {rows_x} x rows exceed the copy's counters ({w.arrivals.numel()})")
    wgmma = policy.mma_int4_wgmma
    splits, tiles_per_split = mma_int4_splits(policy, K // block_k, n_tiles, m_tiles, rows_x)
    part = torch.empty((splits, M, n_total), dtype=torch.float32, device=x.device)
    squares = torch.empty((splits, M), dtype=torch.float32, device=x.device) if flags["NORM"] else part
    # The mma.sync version has no registers to spare for a deeper prefetch.
    deeper = wgmma and rows_x <= policy.mma_int4_wgmma_loads_ahead_max_rows
    ahead = policy.mma_int4_wgmma_loads_ahead if deeper else 1
    registers = policy.mma_int4_wgmma_max_registers if deeper else 0
    cap = {"maxnreg": registers} if registers else {}
    gluon_int4_mma._int4_mma_kernel[(n_tiles, splits, m_tiles)](
        x, w.words, w.pairs, nw, part, squares, w.arrivals, out, res, b, M, n_total, K, tiles_per_split, eps,
        x.stride(0), K // 8, K // w.group_size, out.stride(0), res.stride(0), GROUP=w.group_size, NORM=flags["NORM"],
        BIAS=flags["BIAS"], ACT=flags["ACT"], RESIDUAL=flags["RESIDUAL"], BN=block_n, BK=block_k, MP=rows_x,
        AHEAD=ahead, **gluon_int4_mma.layouts(warps, row_tiles, block_k, rows_x, wgmma, w.group_size),
        num_warps=warps, **cap, **policy.pdl_options(),
    )  # fmt: skip
    return out


def dequantize_int4(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in `dtype`, computed on the weight's device."""
    N, K = w.shape
    out = torch.empty((N, K), dtype=dtype, device=w.packed.device)
    block_n, block_k = 16, max(w.group_size, 128)
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    _dequant_kernel[grid](
        w.packed.view(torch.int32), w.scale, w.minimum, out, N, K, GROUP=w.group_size, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCKED=_block_width(w),
    )  # fmt: skip
    return out


def _dense_weight(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """w as a dense [N, K] tensor in `dtype` (INT4 dequantized into scratch)."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    if not isinstance(w, Int4Weight):
        raise TypeError(f"the CUDA kernels take INT4 or 16-bit weights, got {type(w).__name__}")
    return dequantize_int4(w, dtype)


def _linear_unfused(
    policy: KernelPolicy,
    x: torch.Tensor,
    w: UnfusedWeight,
    norm_weight: torch.Tensor | None,
    eps: float,
    bias: torch.Tensor | None,
    act: int,
    residual: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Many rows: the product in one cuBLAS (or tinygemm) launch (`_product`), with the residual sum in the GEMM
    (or one launch after tinygemm) and SwiGLU in one launch after it."""
    h = rms_norm(policy, x, norm_weight, eps) if norm_weight is not None else x
    b = None if bias is None else bias.to(x.dtype)
    plain_epilogue = act == ACT_NONE and out.dtype == x.dtype
    if plain_epilogue and (residual is None or (b is None and residual.dtype == x.dtype)):
        return _product(h, w, b, residual, out)
    y = _product(h, w, b, None, None)
    if act == ACT_SWIGLU and residual is None:
        M, N = out.shape
        block = min(1024, triton.next_power_of_2(N))
        _swiglu_kernel[(M, triton.cdiv(N, block))](
            y, out, N, y.stride(0), out.stride(0), BLOCK=block, num_warps=4, **policy.pdl_options()
        )
        return out
    if act == ACT_SWIGLU:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    elif act == ACT_GELU:
        y = F.gelu(y)
    if residual is not None:
        y = residual + y
    out.copy_(y)
    return out


def _product(
    h: torch.Tensor, w: UnfusedWeight, b: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """h @ w.T (+ b) (+ residual: only without b), accumulated in float32 and rounded once, into `out` (or a
    new tensor): cuBLAS on the weight in h's dtype (INT4 dequantized into scratch). A tinygemm weight's
    product is its own new tensor, and the bias or residual is added in a second launch (into `out`)."""
    if residual is not None and b is not None:
        raise ValueError("_product fuses a bias or a residual, not both")
    if isinstance(w, CudaTinygemmWeight):
        y = w.mm(h)
        addend = residual if residual is not None else b
        if addend is None:
            return y
        return torch.add(addend, y, out=out) if out is not None else y.add_(addend)
    if out is None and residual is not None:
        out = torch.empty((h.shape[0], w.shape[0]), dtype=h.dtype, device=h.device)
    dense = _dense_weight(w, h.dtype)
    if out is None:
        return F.linear(h, dense, b)
    if residual is not None:
        return torch.addmm(residual, h, dense.t(), out=out)
    if b is not None:
        return torch.addmm(b, h, dense.t(), out=out)
    return torch.mm(h, dense.t(), out=out)


def add(policy: KernelPolicy, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b for contiguous tensors of one shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype or not (a.is_contiguous() and b.is_contiguous()):
        return a + b
    out = torch.empty_like(a)
    n = a.numel()
    block = min(4096, triton.next_power_of_2(n))
    _add_kernel[(triton.cdiv(n, block),)](a, b, out, n, BLOCK=block, num_warps=4, **policy.pdl_options())
    return out


def rms_norm(
    policy: KernelPolicy,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    mode: int = 0,
) -> torch.Tensor:
    """mode 0: norm(x); 1: residual + norm(x); 2: norm(x + residual). x [M, D]."""
    M, D = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    _rms_norm_kernel[(M,)](
        x, res, weight, out, D, eps, x.stride(0), res.stride(0), out.stride(0), MODE=mode,
        BLOCK_D=triton.next_power_of_2(D), num_warps=4 if D <= 4096 else 8, **policy.pdl_options(),
    )  # fmt: skip
    return out


def rope_store(
    policy: KernelPolicy,
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq: int,
    interleaved: bool,
) -> torch.Tensor:
    """qkv [B*T, (H + 2 KVH) hd] -> roped queries [B*T, H, hd]; roped keys and values written into the
    cache slot views k_cache / v_cache [B, KVH, max_seq, hd] at `positions` [B*T]."""
    rows = qkv.shape[0]
    q = torch.empty((rows, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    block_r = min(policy.rope_block_rows, triton.next_power_of_2(rows))
    _rope_store_kernel[(triton.cdiv(rows, block_r), n_heads + 2 * n_kv_heads)](
        qkv, q, k_cache, v_cache, positions, cos, sin, rows, seq, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_HEADS=n_heads, N_KV=n_kv_heads, HEAD_DIM=head_dim, INTERLEAVED=interleaved, BLOCK_R=block_r,
        num_warps=1 if block_r == 1 else 4, **policy.pdl_options(),
    )  # fmt: skip
    return q


def cached_attention(
    policy: KernelPolicy,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    seq: int,
) -> torch.Tensor:
    """q [B*T, H, hd] attends to cache positions 0..positions[i] -> [B*T, H * hd]."""
    rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    out = torch.empty((rows, n_heads * head_dim), dtype=q.dtype, device=q.device)
    block, warps = policy.attention_block(head_dim)
    _cached_attention_kernel[(rows, n_heads)](
        q, k_cache, v_cache, positions, out, seq, head_dim**-0.5,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_HEADS=n_heads, GROUP=n_heads // n_kv, HEAD_DIM=head_dim, BLOCK_S=block, num_warps=warps,
        **policy.pdl_options(),
    )  # fmt: skip
    return out


_SPLIT_SCRATCH: dict[tuple[torch.device, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_scratch(device: torch.device, programs: int, splits: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Partial softmax states and arrival counts for split attention, kept per shape: the counts must be zero
    before a launch and every launch leaves them zero, so a captured graph can reuse them."""
    key = (device, programs, splits, head_dim)
    if key not in _SPLIT_SCRATCH:
        part = torch.empty((programs * splits, head_dim + 2), dtype=torch.float32, device=device)
        _SPLIT_SCRATCH[key] = (part, torch.zeros(programs, dtype=torch.int32, device=device))
    return _SPLIT_SCRATCH[key]


def rope_attention(
    policy: KernelPolicy,
    qkv: torch.Tensor,
    attn: OneTokenAttention,
    *,
    long_cache: bool = False,
) -> torch.Tensor:
    """One token per sequence: `rope_store` + `cached_attention` in one launch. qkv [B, (H + 2 KVH) hd],
    positions [B] -> [B, H * hd]; the new key and value are written into the cache at `positions`. The keys of
    each (row, head) are split among `policy.rope_attention_tile`'s programs (`long_cache`: some row attends to
    `policy.long_cache_keys` keys or more)."""
    rows, n_heads, head_dim, k_cache = qkv.shape[0], attn.n_heads, attn.head_dim, attn.k_cache
    out = torch.empty((rows, n_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    splits, block, warps = policy.rope_attention_tile(rows, n_heads, head_dim, long_cache)
    part = count = out
    if splits > 1:
        part, count = _split_scratch(qkv.device, rows * n_heads, splits, head_dim)
    _rope_attention_kernel[(rows, n_heads, splits)](
        qkv, k_cache, attn.v_cache, attn.positions, attn.cos, attn.sin, out, part, count, head_dim**-0.5,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_HEADS=n_heads, N_KV=attn.n_kv_heads, HEAD_DIM=head_dim, INTERLEAVED=attn.interleaved, BLOCK_S=block,
        SPLITS=splits, num_warps=warps, **policy.pdl_options(),
    )  # fmt: skip
    return out


def int4_rows(policy: KernelPolicy, ids: torch.Tensor, w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """Embedding rows of an INT4 table (plain or blocked layout) for token ids [...] -> [..., D] in `dtype`,
    in one launch."""
    D = w.shape[1]
    flat = ids.reshape(-1)
    out = torch.empty((flat.numel(), D), dtype=dtype, device=ids.device)
    if flat.numel():
        block = min(1024, triton.next_power_of_2(D))
        _int4_rows_kernel[(flat.numel(), triton.cdiv(D, block))](
            flat, w.packed, w.scale, w.minimum, out, D, w.packed.stride(0), w.scale.stride(0),
            GROUP=w.group_size, BLOCKED=isinstance(w, BlockedInt4Weight), BLOCK=block, num_warps=4,
            **policy.pdl_options(),
        )  # fmt: skip
    return out.view(*ids.shape, D)


class CudaKernels:
    """The launchers above bound to one `KernelPolicy`: what a decoder holds and calls."""

    ACT_NONE, ACT_SWIGLU, ACT_GELU = ACT_NONE, ACT_SWIGLU, ACT_GELU

    def __init__(self, policy: KernelPolicy) -> None:
        self.policy = policy

    def fused_linear(self, x: torch.Tensor, w: ProductWeight, **options: Any) -> torch.Tensor:
        return fused_linear(self.policy, x, w, **options)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return add(self.policy, a, b)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 mode: int = 0) -> torch.Tensor:  # fmt: skip
        return rms_norm(self.policy, x, weight, eps, residual, mode)

    def rope_store(self, qkv: torch.Tensor, *args: Any) -> torch.Tensor:
        return rope_store(self.policy, qkv, *args)

    def cached_attention(self, q: torch.Tensor, *args: Any) -> torch.Tensor:
        return cached_attention(self.policy, q, *args)

    def rope_attention(self, qkv: torch.Tensor, attn: OneTokenAttention, *, long_cache: bool = False) -> torch.Tensor:
        return rope_attention(self.policy, qkv, attn, long_cache=long_cache)

    def attention_out_applies(self, rows: int, attn: OneTokenAttention, out_weight: object, long_cache: bool) -> bool:
        return attention_out.attention_out_applies(self.policy, rows, attn, out_weight, long_cache)

    def attention_out(
        self, qkv: torch.Tensor, attn: OneTokenAttention, out_weight: object, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        return attention_out.attention_out(self.policy, qkv, attn, out_weight, residual)

    def int4_rows(self, ids: torch.Tensor, w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
        return int4_rows(self.policy, ids, w, dtype)

    def int4_rows_on_cublas(self, rows: int) -> bool:
        return self.policy.int4_rows_on_cublas(rows)

    def persistent_mlp_applies(self, x: torch.Tensor, gate_up: object, down: object) -> bool:
        return persistent_mlp.persistent_mlp_applies(self.policy, x, gate_up, down)

    def persistent_mlp(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: object, down: object,
                       residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return persistent_mlp.persistent_mlp(self.policy, x, norm_weight, eps, gate_up, down, residual)

    @staticmethod
    def dequantize_int4(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(w, dtype)
