"""The staged GEMV's cut (kernels/gluon_gemv_staged.py): every row covered once, shared memory within budget,
the planned bytes equal to what the kernel allocates. The kernel itself runs only on a GPU with TMA (Gluon has
no interpreter): bench/gpu_suite.py's staged section checks it against float64 and the other GEMVs."""

from __future__ import annotations

import pytest

from tinyloop.kernels import gluon_gemv_staged as staged
from tinyloop.kernels.gluon_gemv_staged import CHUNK_BLOCKS, SMEM_BUDGET, TILE_ROWS, StagedPlan, staged_plan

SEED_407M = [(6144, 2048, 0), (2048, 2048, 0), (5632, 2048, 1), (2048, 5632, 0)]


SHAPES = [*SEED_407M, (1000, 512, 2), (17, 1024, 1), (4096, 8192, 0)]
CASES = [(n, k, act, sms) for n, k, act in SHAPES for sms in (132, 114, 7)]
# Whole 64-column blocks everywhere: a case is refused only for shared memory (the test below checks that).
PLANNED = [c for c in CASES if staged_plan(*c) is not None]
OVER_BUDGET = [c for c in CASES if staged_plan(*c) is None]


def check_cut(plan: StagedPlan, n: int, k: int, sms: int) -> None:
    rows_per_program = plan.tiles * TILE_ROWS
    assert plan.programs * rows_per_program >= n > (plan.programs - 1) * rows_per_program
    assert plan.programs <= sms
    assert plan.chunks * CHUNK_BLOCKS * 64 >= k > (plan.chunks - 1) * CHUNK_BLOCKS * 64
    if plan.tiles > 1:  # one tile fewer would need more programs than SMs
        assert -(-n // ((plan.tiles - 1) * TILE_ROWS)) > sms


@pytest.mark.parametrize(("n", "k", "act", "sms"), PLANNED)
def test_plan_covers_every_row_once_with_one_program_per_sm(n: int, k: int, act: int, sms: int) -> None:
    plan = staged_plan(n, k, act, sms)
    assert plan is not None
    check_cut(plan, n, k, sms)
    assert plan.smem_bytes <= SMEM_BUDGET


@pytest.mark.parametrize(("n", "k", "act", "sms"), OVER_BUDGET)
def test_plan_is_refused_exactly_when_it_needs_more_shared_memory_than_the_budget(
    n: int, k: int, act: int, sms: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staged, "SMEM_BUDGET", 2**40)
    plan = staged_plan.__wrapped__(n, k, act, sms)  # past the cache, which holds the real budget's answer
    assert plan is not None
    check_cut(plan, n, k, sms)
    assert plan.smem_bytes > SMEM_BUDGET


def test_both_outcomes_are_covered() -> None:
    assert len(PLANNED) == 11 and len(OVER_BUDGET) == 10


def test_seed_407m_shapes_all_apply_on_an_h200() -> None:
    plans = {shape: staged_plan(*shape, sms=132) for shape in SEED_407M}
    assert all(p is not None for p in plans.values())
    assert [p.programs for p in plans.values() if p] == [128, 128, 118, 128]
    # Consecutive kernels of a layer fit in one SM's 227 KiB together (gate / up then down is the largest pair).
    sizes = [p.smem_bytes for p in plans.values() if p]
    assert max(a + b for a, b in zip(sizes, sizes[1:] + sizes[:1], strict=True)) <= 227 * 1024


def test_plan_bytes_match_the_kernels_allocation() -> None:
    # Triton 3.6's compiled shared-memory sizes for sm_90 (bench: ptxas of the kernel, seed-407m shapes).
    compiled = {(6144, 2048, 0): 64648, (5632, 2048, 1): 119944, (2048, 5632, 0): 81288, (2048, 2048, 0): 27784}
    for shape, nbytes in compiled.items():
        plan = staged_plan(*shape, sms=132)
        assert plan is not None and abs(plan.smem_bytes - nbytes) <= 64


@pytest.mark.parametrize(
    ("n", "k", "act", "scale_bytes", "why"),
    [(6144, 384, 0, 2, "scale rows of 12 bytes: TMA strides are 16-byte multiples"),
     (6144, 2000, 0, 2, "K not whole 64-column blocks"),
     (32000, 2048, 0, 2, "a vocabulary head: more shared memory than the budget"),
     (0, 2048, 0, 2, "no rows")],
)  # fmt: skip
def test_plan_refuses_what_the_kernel_cannot_take(n: int, k: int, act: int, scale_bytes: int, why: str) -> None:
    assert staged_plan(n, k, act, 132, scale_bytes) is None, why


def test_four_byte_scales_need_only_256_column_multiples() -> None:
    assert staged_plan(2048, 768, 0, 132, scale_bytes=4) is not None
    assert staged_plan(2048, 768, 0, 132, scale_bytes=2) is None
