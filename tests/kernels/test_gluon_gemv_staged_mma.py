"""The tensor-core staged GEMV's CPU-checkable parts (kernels/gluon_gemv_staged_mma.py): the lop3 it emits
turns nibble pairs into 16-bit magic + q exactly, its A-operand order and x's B-operand order name the same
weight columns, and the launcher sends 16-bit x (only) to it. The kernel itself runs only on a GPU with TMA
(Gluon has no interpreter): bench/gpu_suite.py's staged_mma section checks it against float64 there."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from tinyloop.kernels import cuda_ops
from tinyloop.kernels import gluon_gemv_staged_mma as staged_mma
from tinyloop.quant import BlockedInt4Weight, quantize_int4


def _lop3_pair(words: np.ndarray, asm: str) -> np.ndarray:
    """The PTX `_PAIR_*` asm emulated: optional shr, then lop3 with LUT 0xea, i.e. (a & b) | c."""
    shift = re.search(r"shr\.u32 t, \$1, (\d+);", asm)
    mask, magic = (
        int(v, 16) for v in re.search(r"lop3\.b32 \$0, \S+, (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+), 0xea;", asm).groups()
    )  # type: ignore[union-attr]
    assert "0xea" in asm  # (a & b) | c
    w = words.astype(np.int64) & 0xFFFFFFFF
    if shift:
        w >>= int(shift.group(1))
    return ((w & mask) | magic).astype(np.uint32)


@pytest.mark.parametrize(
    ("table", "dtype", "magic"), [("_PAIR_BF16", torch.bfloat16, 128), ("_PAIR_FP16", torch.float16, 1024)]
)
def test_pairs_are_magic_plus_nibbles_s_and_s_plus_4(table: str, dtype: torch.dtype, magic: int) -> None:
    rng = np.random.default_rng(1)
    words = rng.integers(-(2**31), 2**31, 2048, dtype=np.int64).astype(np.int32)
    words[:2] = [-1, 0]
    for s, asm in enumerate(getattr(staged_mma, table).value):
        bits = _lop3_pair(words, asm)
        halves = torch.from_numpy(bits.view(np.int16).copy()).view(dtype).float().numpy().reshape(-1, 2)
        codes = words.astype(np.int64) & 0xFFFFFFFF
        np.testing.assert_array_equal(halves[:, 0], magic + ((codes >> (4 * s)) & 0xF))  # low half: nibble s
        np.testing.assert_array_equal(halves[:, 1], magic + ((codes >> (4 * (s + 4))) & 0xF))  # high: s + 4


def test_a_operand_and_x_name_the_same_columns() -> None:
    """A-operand position k (`_a_operand`: nibble s + 4e of word 2a + w for k = 16s + 8w + 2a + e) is block
    column 8 (s + 4e) + 2a + w in the blocked layout (nibble j of word i is column 8j + i), the column the
    kernel stages x from for B-operand row k; every column once."""
    k = np.arange(64)
    s, w, a, e = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2
    nibble, word = s + 4 * e, 2 * a + w
    a_columns = 8 * nibble + word
    x_columns = staged_mma._b_column.fn(k)
    np.testing.assert_array_equal(a_columns, x_columns)
    assert sorted(x_columns.tolist()) == list(range(64))


def test_applies_to_16_bit_x_and_whole_boxes() -> None:
    assert staged_mma.applies(6144, 2048, 2) and staged_mma.applies(2048, 5632, 2)
    assert not staged_mma.applies(6144, 2048, 4)  # float32 x keeps the CUDA-core kernel
    assert not staged_mma.applies(6144, 1536 + 64, 2)  # not whole 8-block boxes
    assert not staged_mma.applies(0, 2048, 2)


class _Launch:
    def __init__(self, name: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.calls.append((self.name, {"grid": grid, **kwargs}))


_THIS_SHAPE = frozenset({(512, 1536, 1)})
_OTHER_SHAPE = frozenset({(512, 1536, 0)})  # same matrix without SwiGLU: a different shape


@pytest.mark.parametrize(("dtype", "mma_shapes", "expected"), [
    (torch.bfloat16, None, "mma"), (torch.float16, None, "mma"), (torch.bfloat16, _THIS_SHAPE, "mma"),
    (torch.float32, None, "cuda_cores"), (torch.bfloat16, frozenset(), "cuda_cores"),
    (torch.bfloat16, _OTHER_SHAPE, "cuda_cores"),
])  # fmt: skip
def test_staged_launcher_picks_the_tensor_core_kernel_for_16_bit_x_of_listed_shapes(
    dtype: torch.dtype, mma_shapes: frozenset | None, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from tinyloop.kernels import gluon_gemv_staged

    calls: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(staged_mma, "_gemv_int4_staged_mma_kernel", _Launch("mma", calls))
    monkeypatch.setattr(gluon_gemv_staged, "_gemv_int4_staged_kernel", _Launch("cuda_cores", calls))
    monkeypatch.setattr(cuda_ops, "STAGED_MMA_SHAPES", mma_shapes)
    monkeypatch.setattr(cuda_ops, "STAGED_SHAPES", None)
    monkeypatch.setattr(cuda_ops, "_sm_count", lambda index: 132)
    w = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(2 * 512, 1536), 64))
    x, out = torch.randn(1, 1536).to(dtype), torch.empty(1, 512, dtype=dtype)
    flags = {"NORM": False, "BIAS": False, "ACT": 1, "RESIDUAL": False}
    assert cuda_ops._gemv_staged(x, w, out, out, out, out, 1e-6, flags)
    ((name, kwargs),) = calls
    plan = gluon_gemv_staged.staged_plan(512, 1536, 1, 132)
    assert name == expected and plan is not None and kwargs["grid"] == (plan.programs,)
    assert kwargs["TILES"] == plan.tiles and kwargs["ACT"] == 1
    if expected == "mma":
        assert kwargs["GROUPS"] == 1536 // 512 and kwargs["FP16"] == (dtype == torch.float16)


@pytest.mark.parametrize(("pdl", "launch", "expected"), [
    (True, "after_wait", 1), (True, "before_wait", 2), (True, "at_end", 3), (False, "at_end", 0),
])  # fmt: skip
def test_staged_kernels_launch_the_next_kernel_where_configured(
    pdl: bool, launch: str, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_ops, "USE_PDL", pdl)
    monkeypatch.setattr(cuda_ops, "STAGED_LAUNCH_DEPENDENTS", launch)
    assert cuda_ops._staged_pdl()["PDL"] == expected
    monkeypatch.setattr(cuda_ops, "STAGED_LAUNCH_DEPENDENTS", "early")
    with pytest.raises(ValueError, match="after_wait, before_wait or at_end"):
        cuda_ops._staged_pdl()
