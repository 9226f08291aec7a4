"""The dispatch point: registered kernels by (weight kind, device type), the reference path otherwise."""

from __future__ import annotations

import pytest
import torch

from tinyloop.kernels import dispatch
from tinyloop.quant import quantize_int4


def test_embedding_goes_to_the_kernel_registered_for_its_kind_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_EMBEDDING_KERNELS", {})
    table = quantize_int4(torch.randn(10, 64), 32)
    ids = torch.tensor([1, 4])
    reference = dispatch.embedding(ids, table, torch.float32)
    assert torch.equal(reference, table.rows(ids, torch.float32))
    calls = []

    def kernel(i: torch.Tensor, w: dispatch.Weight, dtype: torch.dtype) -> torch.Tensor:
        calls.append((i, w, dtype))
        return torch.full((i.numel(), 64), 7.0, dtype=dtype)

    dispatch.register_embedding_kernel("int4", "cuda", kernel)
    assert torch.equal(dispatch.embedding(ids, table, torch.float32), reference)  # a CPU tensor: not routed
    dispatch.register_embedding_kernel("int4", "cpu", kernel)
    assert bool((dispatch.embedding(ids, table, torch.float16) == 7).all()) and calls[-1][2] == torch.float16
    dense = torch.randn(10, 64)
    assert torch.equal(dispatch.embedding(ids, dense, torch.float32), dense[ids])  # no dense kernel registered
