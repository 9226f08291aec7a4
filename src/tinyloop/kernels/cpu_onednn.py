"""float32 matmuls of the CPU decode step through oneDNN, on weights reordered once into its blocked layout.

On the 2-core AMD EPYC VM (AVX-512) torch.mm's MKL sgemm multiplies 8 rows by the built-in model's body
matrices in 3.0 ms per iteration, 2.9x one row; oneDNN on weights reordered for 8 rows takes 1.2 ms, 1.6x its
one row (0.77 ms, itself faster than MKL's 1.03). Each output row is computed the same way whatever the
number of rows in the call, so a row's product does not depend on the batch it rides in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The row count the reordered layout is tuned for: the CPU decode step's rows (engine batches of up to 8).
PACKED_FOR_ROWS = 8


def available() -> bool:
    """Whether this torch has oneDNN with its packed-weight linear ops."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


@dataclass(frozen=True)
class OneDnnMatrix:
    """A float32 [out, in] matrix in oneDNN's reordered layout (an opaque mkldnn tensor)."""

    packed: torch.Tensor
    shape: torch.Size  # [out, in]


def pack(w: torch.Tensor) -> OneDnnMatrix:
    """w ([out, in] float32 on the CPU, any strides) reordered for PACKED_FOR_ROWS-row products."""
    dense = w.detach().to(torch.float32).contiguous()
    return OneDnnMatrix(reorder(dense), dense.shape)


def reorder(w: torch.Tensor) -> torch.Tensor:
    """w ([out, in] on the CPU, its dtype kept) in oneDNN's blocked layout for PACKED_FOR_ROWS-row products: an
    opaque tensor for `product`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACKED_FOR_ROWS)


def product(x: torch.Tensor, reordered: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ w.T -> a new [rows, out] tensor, w as `reorder` returned it (x in its dtype)."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")


def matmul(x: torch.Tensor, w: OneDnnMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ w.T (+ bias [out]) -> a new [rows, out] tensor, in w's dtype (float32 for `pack`)."""
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, bias, "none", [], "")


def matmul_add(x: torch.Tensor, w: OneDnnMatrix, plus: torch.Tensor) -> torch.Tensor:
    """x @ w.T + plus ([rows, out], or [out]: a bias), the sum fused into the product: a new tensor."""
    if plus.dim() == 1:
        return matmul(x, w, plus)
    return torch.ops.mkldnn._linear_pointwise(x, plus, w.packed, None, "add")
