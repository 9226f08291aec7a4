"""bfloat16 INT4 matmuls on the CPU (kernels/cpu_int4.py) against float64 math."""

from __future__ import annotations

import pytest
import torch

from helpers import frob_rel_error
from shared_data import unavailable
from tinyloop.kernels import cpu_int4, cpu_onednn
from tinyloop.kernels.dispatch import embedding, linear, weight_kind
from tinyloop.quant import BlockedInt4Weight, CpuInt4Weight, Int4Weight, quantize_int4

if not cpu_int4.available():
    unavailable(f"torch {torch.__version__} has no CPU INT4 kernel (torch._weight_int4pack_mm_for_cpu)")

# One bfloat16 rounding of each output (2^-9) and of each input, summed over a dot product.
KERNEL_TOL = 6e-3


def _int4(out_f: int, in_f: int, group: int, seed: int) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize_int4(torch.randn(out_f, in_f, generator=gen) / in_f**0.5, group)


def _kernel_weight_f64(w: CpuInt4Weight) -> torch.Tensor:
    """What the kernel multiplies by, in float64: (q - 8) * scale + zero from its bfloat16 scales and zeros."""
    q = w.codes(w.packed).double()  # [out, in]
    scale = w.scales_zeros[..., 0].double().t().repeat_interleave(w.group_size, dim=1)  # [out, in]
    zero = w.scales_zeros[..., 1].double().t().repeat_interleave(w.group_size, dim=1)
    return (q - 8) * scale + zero


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_matmul_matches_float64(group: int, rows: int) -> None:
    w = cpu_int4.pack(_int4(48, 256, group, seed=group + rows))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    y = cpu_int4.matmul(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 48)
    exact = x.double() @ w.dequantize(torch.float64).T  # the stored INT4 weight, float64 throughout
    assert frob_rel_error(y, exact) <= KERNEL_TOL
    if rows <= cpu_int4.INT4_MAX_ROWS:  # the kernel's own weight, so only the bfloat16 roundings remain
        kernel = x.bfloat16().double() @ _kernel_weight_f64(w).T
        assert frob_rel_error(y, kernel) <= 2**-8


def test_weight_views_and_layout() -> None:
    plain = _int4(32, 128, 64, seed=1)
    w = cpu_int4.pack(plain)
    assert isinstance(w, CpuInt4Weight) and weight_kind(w) == "int4_cpu"
    assert torch.equal(w.dequantize(torch.bfloat16), plain.dequantize(torch.bfloat16))
    assert torch.equal(w.dequantize(torch.float32), plain.dequantize(torch.float32))
    assert w.nbytes > plain.nbytes + w.dense.nbytes
    assert w.to("cpu") is w
    moved = w.to("meta")
    assert type(moved) is Int4Weight and moved.packed.device.type == "meta"
    ids = torch.tensor([[3, 0, 31]])
    assert torch.equal(embedding(ids, w, torch.float32), plain.dequantize(torch.bfloat16)[ids].float())


def test_packable_shapes_and_kinds() -> None:
    assert cpu_int4.packable(_int4(32, 64, 32, seed=2))
    assert not cpu_int4.packable(_int4(40, 64, 32, seed=2))  # outputs not a multiple of 16
    assert not cpu_int4.packable(BlockedInt4Weight.from_int4(_int4(32, 64, 32, seed=2)))
    with pytest.raises(ValueError, match="plain Int4Weight"):
        CpuInt4Weight.from_int4(cpu_int4.pack(_int4(32, 64, 32, seed=2)))


@pytest.mark.parametrize(("start", "stop"), [(0, 64), (64, 128), (32, 96)])
def test_input_columns(start: int, stop: int) -> None:
    w = cpu_int4.pack(_int4(32, 128, 32, seed=3))
    part = cpu_int4.input_columns(w, start, stop)
    x = torch.randn(2, stop - start, generator=torch.Generator().manual_seed(4))
    exact = x.double() @ w.dequantize(torch.float64)[:, start:stop].T
    got = cpu_int4.matmul(x, part) if isinstance(part, CpuInt4Weight) else x.bfloat16() @ part.T
    assert isinstance(part, CpuInt4Weight)  # every cut here falls on 32-column groups
    assert frob_rel_error(got, exact) <= KERNEL_TOL


def test_input_columns_off_group_bounds_are_dense() -> None:
    w = cpu_int4.pack(_int4(32, 128, 64, seed=5))
    part = cpu_int4.input_columns(w, 32, 96)
    assert isinstance(part, torch.Tensor) and torch.equal(part, w.dense[:, 32:96])


def test_linear_keeps_the_input_dtype_and_shape() -> None:
    w = cpu_int4.pack(_int4(64, 96, 32, seed=6))
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(7))
    y = linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 64)
    assert frob_rel_error(y, x.double() @ w.dequantize(torch.float64).T) <= KERNEL_TOL


def test_many_rows_products_round_a_row_alike_whatever_rows_come_with_it() -> None:
    """Past INT4_MAX_ROWS the bfloat16 copy multiplies (reordered once for oneDNN where torch has it): a row's
    product is the same in a call of 9 rows as of 200, and equals F.linear on the plain copy."""
    w = cpu_int4.pack(_int4(64, 256, 64, seed=8))
    x = torch.randn(200, 256, generator=torch.Generator().manual_seed(9))
    whole = cpu_int4.matmul(x, w)
    for lo, hi in ((0, 9), (50, 90), (191, 200)):
        assert torch.equal(cpu_int4.matmul(x[lo:hi], w), whole[lo:hi])
    assert torch.equal(whole, torch.nn.functional.linear(x.bfloat16(), w.dense))
    assert frob_rel_error(whole, x.double() @ w.dequantize(torch.float64).T) <= KERNEL_TOL


def test_only_a_lookup_table_keeps_its_plain_copy() -> None:
    plain = _int4(32, 128, 64, seed=10)
    table, matrix = cpu_int4.pack(plain, table=True), cpu_int4.pack(plain)
    assert table.table is not None and torch.equal(table.dense, matrix.dense)
    assert torch.equal(matrix.dense, plain.dequantize(torch.bfloat16))
    if cpu_onednn.available():  # the matrix is kept reordered alone
        assert matrix.table is None and matrix.many_rows.is_mkldnn and table.nbytes > matrix.nbytes
