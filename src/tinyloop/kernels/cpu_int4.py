"""bfloat16 matmuls of INT4 weights on the CPU: torch's CPU INT4 kernel for few rows, a dense GEMM for many.

A decode step reads every body matrix L times, and the built-in model's float32 body (28 MB) does not stay
in a small machine's L3; its 4-bit codes (3.5 MB) do. torch's CPU INT4 kernel has a vectorised path for
bfloat16 activations only (float32 and float16 take a scalar path ~30x slower), so a call rounds its input
to bfloat16 and returns the product in the input's dtype: activations, norms, attention and the KV cache
stay float32, where small CPU ops are fastest. Above `INT4_MAX_ROWS` rows the dense bfloat16 copy is
faster (still ~2x float32's GEMM at 128 rows); it is kept in oneDNN's reordered layout where torch has oneDNN
(kernels/cpu_onednn.py), which gives F.linear's products bit for bit without reordering the matrix every call
(a 28-token prefill's products: 30 % less time). `tinyloop.Model(..., dtype=torch.bfloat16)` selects this
on the CPU (runtime/loader.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyloop.kernels import cpu_onednn
from tinyloop.kernels.dispatch import register_embedding_kernel, register_linear_kernel
from tinyloop.quant import CpuInt4Weight, Int4Weight

# Rows up to this count go through the INT4 kernel (2 threads, the built-in model's body: 8 rows 5.7 ms
# against 8.7 dense; one thread 10.8 against 17.7); more rows multiply the dense copy.
INT4_MAX_ROWS = 8
# The kernel packs output columns in blocks of this many.
_COLUMN_BLOCK = 16


def available() -> bool:
    """Whether this torch has the CPU INT4 kernel and its packing op."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def packable(w: Int4Weight) -> bool:
    """Whether w can take the CPU INT4 layout: a plain Int4Weight on the CPU with a multiple of 16 outputs."""
    return type(w) is Int4Weight and w.packed.device.type == "cpu" and w.shape[0] % _COLUMN_BLOCK == 0 and available()


def pack(w: Int4Weight, table: bool = False) -> CpuInt4Weight:
    """w in the CPU INT4 layout, with the matmul and lookup kernels routed to it. table: also keep the plain
    bfloat16 matrix, for row lookups (the embedding)."""
    install()
    layout = cpu_onednn.reorder if cpu_onednn.available() else None
    return CpuInt4Weight.from_int4(w, many_rows_layout=layout, table=table)


def input_columns(w: CpuInt4Weight, start: int, stop: int) -> CpuInt4Weight | torch.Tensor:
    """The matrix of inputs start..stop of w: still INT4 when the cut falls on group bounds, else dense."""
    g = w.group_size
    if start % g or stop % g:
        return w.dense[:, start:stop].contiguous()
    part = Int4Weight(
        w.packed[:, start // 2 : stop // 2].contiguous(),
        w.scale[:, start // g : stop // g].contiguous(),
        w.minimum[:, start // g : stop // g].contiguous(),
        g,
    )
    return pack(part)


def matmul(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    """x [rows, in] @ w.T -> [rows, out] in bfloat16 (callers copy or add it into their own dtype)."""
    xb = x.to(torch.bfloat16).contiguous()
    if x.shape[0] <= INT4_MAX_ROWS:
        return torch._weight_int4pack_mm_for_cpu(xb, w.tinygemm, w.group_size, w.scales_zeros)
    if w.many_rows.is_mkldnn:
        return cpu_onednn.product(xb, w.many_rows)
    return F.linear(xb, w.many_rows)


def _linear(x: torch.Tensor, w: object) -> torch.Tensor:
    assert isinstance(w, CpuInt4Weight)
    y = matmul(x.reshape(-1, x.shape[-1]), w).to(x.dtype)
    return y.view(*x.shape[:-1], w.shape[0])


def _embedding(ids: torch.Tensor, w: object, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the bfloat16 copy: the same table the CPU decode step looks up."""
    assert isinstance(w, CpuInt4Weight)
    return F.embedding(ids, w.dense).to(dtype)


def install() -> None:
    """Route linear layers and lookups of CpuInt4Weight on the CPU here (registering again changes nothing)."""
    register_linear_kernel("int4_cpu", "cpu", _linear)
    register_embedding_kernel("int4_cpu", "cpu", _embedding)
