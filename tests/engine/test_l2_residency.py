"""L2 residency planning and the looped-weight arena (kernels/l2_residency.py), on CPU."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tinyloop.env import RuntimeEnv
from tinyloop.kernels import l2_residency as l2
from tinyloop.quant import BlockedInt4Weight, Int4Weight, quantize_int4

MIB = 2**20


def test_plan_window_fits_refuses_or_shares() -> None:
    assert l2.plan_window(10 * MIB, 30 * MIB, 100 * MIB, partial=False) == (10 * MIB, 1.0)
    assert l2.plan_window(40 * MIB, 30 * MIB, 100 * MIB, partial=False) is None
    # Limited by the window rather than the persisting share.
    assert l2.plan_window(40 * MIB, 60 * MIB, 32 * MIB, partial=False) is None
    window, ratio = l2.plan_window(40 * MIB, 30 * MIB, 100 * MIB, partial=True) or (0, 0.0)
    assert window == 40 * MIB and ratio == pytest.approx(0.75)
    window, ratio = l2.plan_window(200 * MIB, 30 * MIB, 128 * MIB, partial=True) or (0, 0.0)
    assert window == 128 * MIB and ratio == pytest.approx(30 / 128)
    assert l2.plan_window(0, 30 * MIB, 100 * MIB, partial=True) is None
    assert l2.plan_window(10 * MIB, 0, 100 * MIB, partial=True) is None  # a device without persisting L2


def test_pack_contiguous_copies_into_aligned_views_of_one_arena() -> None:
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randint(0, 256, (7, 13), generator=g, dtype=torch.uint8),
        torch.randn(5, 3, generator=g).to(torch.float16),
        torch.randn(11, generator=g),
        torch.randn(4, 9, generator=g).t(),  # not contiguous: the copy is
    ]
    arena, views = l2.pack_contiguous(tensors, align=256)
    assert arena.dtype == torch.uint8 and arena.numel() == 4 * 256
    for t, v in zip(tensors, views, strict=True):
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert torch.equal(v, t)
        offset = v.data_ptr() - arena.data_ptr()
        assert offset % 256 == 0 and 0 <= offset < arena.numel()
        assert v.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="at least one tensor"):
        l2.pack_contiguous([])


def test_pack_looped_moves_only_looped_weights_and_keeps_their_kind() -> None:
    g = torch.Generator().manual_seed(5)
    plain = quantize_int4(torch.randn(32, 128, generator=g), 64)
    blocked = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(48, 128, generator=g), 64))
    dense = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    norm = torch.randn(32, generator=g)
    prelude = quantize_int4(torch.randn(32, 128, generator=g), 64)
    weights = {
        "prelude.0.attn.wq": prelude,
        "body.0.attn.wq": blocked,
        "body.0.mlp.w1": plain,
        "body.0.attn_norm.weight": norm,
        "adapter.weight": dense,
    }
    packed, arena = l2.pack_looped(weights)
    assert arena is not None
    assert packed["prelude.0.attn.wq"] is prelude
    for name in ("body.0.attn.wq", "body.0.mlp.w1", "adapter.weight", "body.0.attn_norm.weight"):
        before, after = weights[name], packed[name]
        assert type(after) is type(before)
        if isinstance(before, Int4Weight):
            assert isinstance(after, Int4Weight) and after.group_size == before.group_size
            assert torch.equal(after.dequantize(torch.float32), before.dequantize(torch.float32))
            start = after.packed.data_ptr() - arena.data_ptr()
        else:
            assert isinstance(after, torch.Tensor) and torch.equal(after, before)
            start = after.data_ptr() - arena.data_ptr()
        assert 0 <= start < arena.numel()
    assert l2.pack_looped({"prelude.0.attn.wq": prelude}) == ({"prelude.0.attn.wq": prelude}, None)


def test_keep_looped_resident_off_or_not_on_cuda_leaves_weights_and_says_why() -> None:
    w = {"body.0.mlp.w1": torch.randn(256, 512), "head.weight": torch.randn(8, 256)}
    same, plan = l2.keep_looped_resident(w, torch.device("cpu"), 50 * MIB)
    assert plan.window is None and same["body.0.mlp.w1"] is w["body.0.mlp.w1"]
    assert plan.line == "L2 residency: looped body 0.5 MiB, L2 50 MiB: not on CUDA"
    _, plan = l2.keep_looped_resident(w, torch.device("cpu"), 50 * MIB, "TINYLOOP_DISABLE_L2_RESIDENCY")
    assert plan.window is None and plan.line.endswith(": off (TINYLOOP_DISABLE_L2_RESIDENCY)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver path")
def test_keep_looped_resident_without_a_driver_says_not_applied() -> None:
    w = {"body.0.mlp.w1": torch.randn(64, 64)}
    same, plan = l2.keep_looped_resident(w, torch.device("cuda"), 50 * MIB)
    assert plan.window is None and same["body.0.mlp.w1"] is w["body.0.mlp.w1"]
    assert "not applied (" in plan.line


def test_driver_structures_match_cuda_h_sizes() -> None:
    # CUaccessPolicyWindow: pointer, size_t, float, two enums (28 bytes, padded to 32); CUstreamAttrValue: 64.
    assert ctypes.sizeof(l2._AccessPolicyWindow) == 32
    assert ctypes.sizeof(l2._StreamAttrValue) == 64


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TINYLOOP_DISABLE_L2_RESIDENCY", raising=False)
    assert not RuntimeEnv.read().disable_l2_residency
    monkeypatch.setenv("TINYLOOP_DISABLE_L2_RESIDENCY", "1")
    assert RuntimeEnv.read().disable_l2_residency


def test_window_during_sets_then_clears_even_when_the_block_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(l2, "set_stream_window", lambda stream, window: calls.append(("set", window)))
    monkeypatch.setattr(l2, "clear_stream_window", lambda stream: calls.append(("clear", stream)))
    window = l2.L2Window(4096, 1 << 20, 0.5)
    stream = object()
    with l2.window_during(stream, window) as why:  # type: ignore[arg-type]
        assert why is None and calls == [("set", window)]
    assert calls == [("set", window), ("clear", stream)]
    calls.clear()
    with pytest.raises(KeyError), l2.window_during(stream, window):  # type: ignore[arg-type]
        raise KeyError("capture failed")
    assert calls == [("set", window), ("clear", stream)]
    calls.clear()
    with l2.window_during(stream, None) as why:  # type: ignore[arg-type]
        assert why is None
    assert calls == []


def test_window_during_says_why_when_the_driver_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(stream: object, window: object) -> None:
        raise l2.DriverError("cuStreamSetAttribute returned CUresult 1")

    cleared: list[object] = []
    monkeypatch.setattr(l2, "set_stream_window", refuse)
    monkeypatch.setattr(l2, "clear_stream_window", cleared.append)
    with l2.window_during(object(), l2.L2Window(4096, 1 << 20, 1.0)) as why:  # type: ignore[arg-type]
        assert why is not None and "CUresult 1" in why
    assert cleared == []
