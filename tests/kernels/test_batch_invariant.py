"""Batch-invariant decoding (TINYLOOP_BATCH_INVARIANT=1): the switch and what it needs, one tile and one K split
per matrix at every row count, every step routed to the kernels it fixes, the models and steps it refuses, and
the per-query attention it gives every step, against the naive float64 model. That batched and lone rows are
then the same bits is the warpgroup INT4 kernel's property on a Hopper GPU: bench/batch_invariance.py and
docs/BENCHMARKS.md."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from helpers import max_rel_error
from kernels.test_fused_decode import build
from kernels.test_gluon_int4_mma import _shaped
from naive_reference import naive_forward
from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_backend, cuda_ops, gluon_int4_mma
from tinyloop.kernels.cuda_ops import CudaKernels, mma_int4_applies, mma_int4_splits
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.quant import CudaMmaInt4Weight
from tinyloop.runtime import fused_decode
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.fused_decode import FusedDecoder

SWITCH = "TINYLOOP_BATCH_INVARIANT"
# seed-407m's and the Ouro-1.4B shape's matrices: qkv, out, gate / up, down, the two heads
SHAPES = ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048), (49152, 2048))
ROWS = (1, 2, 3, 5, 8, 16, 17, 31, 32, 33, 64, 100, 512, 2048)


def _gpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine has every kernel a Hopper GPU has."""
    monkeypatch.setattr(cuda_backend, "triton_available", lambda: True)
    for name in ("pdl_supported", "gluon_supported", "staged_supported", "tinygemm_supported", "mma_int4_supported",
                 "mma_int4_wgmma_supported"):  # fmt: skip
        monkeypatch.setattr(cuda_backend, name, lambda: True)


def test_the_switch_needs_the_warpgroup_kernel_and_excludes_persistent_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (SWITCH, "TINYLOOP_PERSISTENT_DECODE", "TINYLOOP_DISABLE_MMA_INT4"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(SWITCH, "1")
    with pytest.raises(ValueError, match="TINYLOOP_BATCH_INVARIANT=1 needs the warpgroup INT4 kernel: a Hopper GPU"):
        cuda_backend.kernel_policy(RuntimeEnv.read())  # this machine has none
    _gpu_kernels(monkeypatch)
    policy = cuda_backend.kernel_policy(RuntimeEnv.read())
    assert policy.batch_invariant and policy.mma_int4 and policy.mma_int4_wgmma
    monkeypatch.setenv(SWITCH, "0")
    assert not cuda_backend.kernel_policy(RuntimeEnv.read()).batch_invariant
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv("TINYLOOP_DISABLE_MMA_INT4", "1")
    with pytest.raises(ValueError, match="TINYLOOP_DISABLE_MMA_INT4 unset"):
        cuda_backend.kernel_policy(RuntimeEnv.read())
    monkeypatch.delenv("TINYLOOP_DISABLE_MMA_INT4")
    monkeypatch.setenv("TINYLOOP_PERSISTENT_DECODE", "1")
    with pytest.raises(ValueError, match="exclude each other"):
        cuda_backend.kernel_policy(RuntimeEnv.read())


@pytest.mark.parametrize("max_splits", [0, 4])
def test_one_tile_and_one_split_per_matrix_at_every_row_count(max_splits: int) -> None:
    """Batch invariant, a matrix's tile (warps, row tiles, columns a step) and K splits are the same at every row
    count (under the split cap where one is set), and every row count takes the tensor-core kernel; by default
    they follow the rows."""
    invariant = KernelPolicy(mma_int4=True, mma_int4_wgmma=True, batch_invariant=True,
                             batch_invariant_max_splits=max_splits)  # fmt: skip
    default = dataclasses.replace(invariant, batch_invariant=False)
    most_splits = 0
    for n, k in SHAPES:
        plans = set()
        for rows in ROWS:
            warps, row_tiles, block_k, rows_x = invariant.mma_int4_tile(n, k, rows)
            n_tiles, m_tiles = n // (16 * warps * row_tiles), -(-rows // rows_x)
            plans.add((warps, row_tiles, block_k, mma_int4_splits(invariant, k // block_k, n_tiles, m_tiles, rows_x)))
            assert rows_x in (16, 32) and invariant.mma_int4_takes_rows(rows)
        assert len(plans) == 1, (n, k, plans)
        most_splits = max(most_splits, next(iter(plans))[3][0])
        assert all(mma_int4_applies(invariant, _shaped(n, k), rows) for rows in ROWS), (n, k)
        default_plans = set()
        for rows in (2, 8, 32):
            warps, row_tiles, block_k, rows_x = default.mma_int4_tile(n, k, rows)
            n_tiles = n // (16 * warps * row_tiles)
            default_plans.add((warps, row_tiles, mma_int4_splits(default, k // block_k, n_tiles, 1, rows_x)))
        assert len(default_plans) > 1, (n, k)
    assert not default.mma_int4_takes_rows(1) and not default.mma_int4_takes_rows(64)
    # uncapped, out and down split 15-16 ways; the cap holds every matrix to it
    assert most_splits == (max_splits or 16)


def test_every_step_multiplies_the_tensor_core_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-token steps of any batch and prompt chunks of any length multiply the same tensor-core INT4 copies;
    no 16-bit copy or tinygemm repack is made."""
    _, _, fused, _ = build("ouro-like", blocked=True)
    decoder = fused.decoder
    assert isinstance(decoder, FusedDecoder)
    policy = dataclasses.replace(fused.kernel_policy, mma_int4=True, mma_int4_wgmma=True, batch_invariant=True)
    decoder.kernels = CudaKernels(policy)
    monkeypatch.setattr(decoder.engine, "dtype", torch.bfloat16)
    monkeypatch.setattr(gluon_int4_mma, "available", lambda: True)
    monkeypatch.setattr(decoder, "_tinygemm_fits", True)
    weights = decoder.step_weights(1, 1)
    assert weights and all(isinstance(w, CudaMmaInt4Weight) for w in weights.values())
    for batch, tokens in ((2, 1), (5, 1), (64, 1), (1, 40), (3, 200)):
        assert decoder.step_weights(batch, tokens) == weights
        assert decoder.dense_copies(batch, tokens) == {} and not decoder._takes_tinygemm(batch, tokens)
    assert decoder.dense_copy_bytes == 0 and decoder.tinygemm_bytes == 0
    decoder.release()


def test_refuses_models_whose_steps_it_cannot_fix() -> None:
    """A float32 model, a model of 16-bit matrices, or matrices the warpgroup tile does not divide: a clear error
    when the decoder is made, not decoding some steps on other kernels."""
    _, _, fused, _ = build("ouro-like", blocked=True)
    policy = dataclasses.replace(fused.kernel_policy, mma_int4=True, mma_int4_wgmma=True, batch_invariant=True)
    with pytest.raises(ValueError, match=r"needs bfloat16 or float16 compute \(this model computes in float32\)"):
        FusedDecoder(Engine(fused.cfg, fused.weights, fused.device, torch.float32, kernel_policy=policy))
    decoder = FusedDecoder.__new__(FusedDecoder)  # the checks alone, on a bfloat16 engine
    decoder.engine = SimpleNamespace(dtype=torch.bfloat16)  # type: ignore[assignment]
    decoder.kernels, decoder._supported, decoder._tinygemm_fits = CudaKernels(policy), True, True
    matrices = [lw.qkv for lw in fused.weights.body]
    n, k = matrices[0].shape
    with pytest.raises(ValueError, match=rf"tile divides \(not \({n}, {k}\), groups of 64\)"):
        decoder._check_batch_invariant(matrices)  # the tile takes 256 rows at a time
    decoder._check_batch_invariant([])
    with pytest.raises(ValueError, match=r"needs INT4 matrices \(found a 16-bit \(3, 64\) matrix"):
        decoder._check_batch_invariant([torch.zeros(3, 64)])
    decoder._supported = False
    with pytest.raises(ValueError, match="RMSNorm model of plain INT4 matrices"):
        decoder._check_batch_invariant(matrices)


def test_steps_on_the_generic_path_are_refused() -> None:
    """Per-iteration states (and any other step the fused decoder does not take) would run on torch's kernels,
    whose rows depend on the batch: refused, naming why."""
    _, _, fused, _ = build("ouro-like", blocked=True)
    fused.kernel_policy = dataclasses.replace(fused.kernel_policy, batch_invariant=True)
    cache = fused.new_cache(1, 8, 2)
    with pytest.raises(ValueError, match=r"covers the fused CUDA steps only; .*\(per-iteration states\)"):
        fused.step(torch.tensor([[1, 2]]), cache, 2, collect_states=True)


@pytest.mark.parametrize("variant", ["ouro-like", "huginn-like"])
def test_per_query_attention_and_fixed_row_gate_decode_like_the_naive_reference(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the switch on, a 20-token prompt (past the 16 tokens where SDPA would take it) and one-token steps of
    five rows (past the four where the exit gate's logit would go to torch) attend through the cached-attention
    kernel (RoPE and the cache write first), never the split one-token kernel or SDPA, take the fixed-row gate
    product, and give the naive float64 model's logits and gates for every row."""
    cfg, dense, fused, _ = build(variant, blocked=True)
    policy = dataclasses.replace(fused.kernel_policy, batch_invariant=True)
    kernels = CudaKernels(policy)
    fused.decoder.kernels = kernels  # type: ignore[union-attr]
    fused.kernel_policy = policy
    attended: list[int] = []
    cached = kernels.cached_attention
    monkeypatch.setattr(kernels, "cached_attention", lambda q, *a: attended.append(q.shape[0]) or cached(q, *a))
    monkeypatch.setattr(kernels, "rope_attention", None)
    monkeypatch.setattr(fused_decode, "sdpa", None)
    loops, rows, prompt = 2, 5, 20
    gen = torch.Generator().manual_seed(4)
    seqs = torch.randint(0, cfg.vocab_size, (rows, prompt + 2), generator=gen)
    cache = fused.new_cache(rows, prompt + 2, loops)
    fused.step(seqs[:, :prompt], cache, loops)
    for t in range(prompt, prompt + 2):
        out = fused.step(seqs[:, t : t + 1], cache, loops, last_only=True)
        for b in range(rows):
            ref_logits, _, ref_gates = naive_forward(cfg, dense, seqs[b, : t + 1].tolist(), loops, fused.noise)
            assert max_rel_error(out.logits[b, -1], ref_logits[t]) <= 1e-4, (b, t)
            if cfg.exit_gate:
                got = torch.stack([g[b, -1] for g in out.gates])
                assert max_rel_error(got, torch.stack([r[t] for r in ref_gates])) <= 1e-4, (b, t)
    layers = cfg.n_prelude + loops * cfg.n_body + cfg.n_coda
    assert attended == [rows * prompt] * layers + [rows] * 2 * layers


def test_launch_rows_of_the_16bit_product_stay_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch invariant, the 16-bit GEMV (the exit gate's product) launches with the same row count and tile for
    any number of rows; by default the last launch of a batch takes its own row count."""
    launches: list[tuple[int, int, int]] = []

    class Recorder:
        def __getitem__(self, grid: object) -> object:
            return lambda *args, **kw: launches.append((args[8], kw["ROWS"], kw["BLOCK_N"]))

    monkeypatch.setattr(cuda_ops, "_matvec_kernel", Recorder())
    w = torch.randn(1, 64)
    shapes = {}
    for invariant in (True, False):
        launches.clear()
        policy = KernelPolicy(batch_invariant=invariant, cublas_16bit=False)
        for rows in (1, 3, 6):
            cuda_ops.fused_linear(policy, torch.randn(rows, 64), w, out_dtype=torch.float32)
        assert [m for m, _, _ in launches] == [1, 3, 4, 2]  # rows a launch: at most matvec_max_rows
        shapes[invariant] = {(rows, block) for _, rows, block in launches}
    assert len(shapes[True]) == 1 and next(iter(shapes[True]))[0] == 4 and len(shapes[False]) == 3


def test_a_prompt_past_the_counters_runs_in_row_blocks_of_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A product of more rows than the copy's tile counters cover (long prompt chunks) launches once per block of
    rows, each block with the matrix's one plan, writing its own rows of the output and reading its own rows of
    the residual."""
    launches: list[tuple[int, tuple[int, ...], int, int, int]] = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            def launch(x, w, sm, nw, part, squares, arrivals, out, res, *rest, **kw):  # type: ignore[no-untyped-def]
                launches.append((x.shape[0], grid, rest[4], out.data_ptr(), res.data_ptr()))

            return launch

    monkeypatch.setattr(gluon_int4_mma, "_int4_mma_kernel", Recorder())
    policy = KernelPolicy(mma_int4=True, mma_int4_wgmma=True, batch_invariant=True)
    w = _shaped(2048, 2048)
    x, residual = torch.randn(5000, 2048, dtype=torch.bfloat16), torch.randn(5000, 2048, dtype=torch.bfloat16)
    out = cuda_ops.fused_linear(policy, x, w, residual=residual)
    counted = w.arrivals.numel() // (2048 // 128) * 32
    assert [rows for rows, *_ in launches] == [counted, counted, 5000 - 2 * counted]
    assert len({(grid[:2], tiles) for _, grid, tiles, _, _ in launches}) == 1  # one plan: tiles and K splits
    row_bytes = 2048 * 2
    assert [o - out.data_ptr() for *_, o, _ in launches] == [0, counted * row_bytes, 2 * counted * row_bytes]
    assert [r - residual.data_ptr() for *_, r in launches] == [0, counted * row_bytes, 2 * counted * row_bytes]
    with pytest.raises(ValueError, match="exceed the copy's counters"):
        cuda_ops.fused_linear(dataclasses.replace(policy, batch_invariant=False), x, w, residual=residual)
