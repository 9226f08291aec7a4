"""Launchers for the Triton kernels: shapes, launch configurations and the choice of kernel per size.

Every function takes and returns plain tensors (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1,
which is how the CPU test suite checks the kernels).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
import triton

from tinyloop.kernels.dispatch import Weight
from tinyloop.kernels.triton_attention import _cached_attention_kernel, _rope_attention_kernel, _rope_store_kernel
from tinyloop.kernels.triton_elementwise import _add_kernel, _swiglu_kernel
from tinyloop.kernels.triton_embedding import _int4_rows_kernel
from tinyloop.kernels.triton_matmul import (
    _dequant_kernel,
    _gemm_blocked_int4_kernel,
    _gemv_blocked_int4_kernel,
    _matmul_kernel,
    _matvec_kernel,
    _splitk_blocked_int4_kernel,
    _splitk_epilogue_kernel,
)
from tinyloop.kernels.triton_norm import _rms_norm_kernel
from tinyloop.log import info
from tinyloop.quant import BlockedInt4Weight, Int4Weight

ACT_NONE, ACT_SWIGLU, ACT_GELU = 0, 1, 2

# Row counts that pick the kernel: up to MATVEC_MAX_ROWS the CUDA-core matvec; up to DOT_MAX_ROWS the
# tensor-core Triton kernel with INT4 dequantized per tile; beyond, the weight is dequantized into a
# scratch buffer and multiplied by cuBLAS. On an H200 (docs/BENCHMARKS.md) dequantize + cuBLAS beat
# every tensor-core tile tried from 16 rows up (qkv of seed-407m: 18.7 vs 23.1 us at 16 rows, 57 vs
# 224 us at 1024), so the tensor-core kernel is only used where cuBLAS is switched off.
MATVEC_MAX_ROWS = 4
DOT_MAX_ROWS = 4
# Blocked INT4 weights (what CUDA engines run) take the split-K tensor-core kernel from MATVEC_MAX_ROWS + 1
# up to this many rows, dequantize + cuBLAS beyond.
BLOCKED_GEMM_MAX_ROWS = 16
# The split-K kernel splits K until about this many programs run (two per SM of an H100/H200).
SPLITK_PROGRAMS = 264
# From BLOCKED_GEMM_MAX_ROWS + 1 up to this many rows, blocked INT4 weights take the pipelined tensor-core
# kernel (`_gemm_blocked_int4_kernel`, reading the 4-bit words) instead of dequantize + cuBLAS; 0: never.
# Never: on the H200 it is 2-3x slower than cuBLAS on the dequantized weight at 32-128 rows, and seed-407m's
# prefill of 128 tokens took 4.8-5.0 ms with it against 2.9-3.1 without.
# With cuBLAS switched off it still replaces the split-K kernel from BLOCKED_GEMM_MAX_ROWS + 1 rows up.
INT4_GEMM_MAX_ROWS = 0

# RoPE + cache write: rows per program (fewer, bigger programs for long prefills).
ROPE_BLOCK_ROWS = 16

# Cached attention: keys per iteration and warps per (row, head) program. Few programs run (one per
# head), so each takes big bites of the cache to keep enough loads in flight, and the one-token kernel loads
# its first block before the PDL wait. H200, seed-407m, chain_tiles (64 tokens at 8 loops after
# a 128-token prompt, so 129-192 keys as in the benchmark's decode): 89.0 ms at 256 keys / 8 warps against
# 94.1 at 128 / 4, 95.0 at 128 / 8, 98.7 at 64 / 4 and 99.6 at 256 / 16. An earlier sweep
# measured at 65-128 keys, where one 128-key block already covers everything, and preferred 128 / 4.
ATTENTION_BLOCK = 256
ATTENTION_WARPS = 8
# Heads narrower than 128 keep 128 keys / 4 warps: the built-in tiny model (6 heads of 64)
# decoded 2,364 tokens/s at 8 loops with it and 2,262-2,274 with 256 / 8 (three runs).
NARROW_HEAD_ATTENTION = (128, 4)


def _attention_tile(head_dim: int) -> tuple[int, int]:
    return (ATTENTION_BLOCK, ATTENTION_WARPS) if head_dim >= 128 else NARROW_HEAD_ATTENTION


# (N, K, rows) -> (BLOCK_N, BLOCK_K, num_warps); filled by benchmark sweeps to override the heuristic.
MATVEC_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int]] = {}
# The same for the blocked-layout INT4 GEMV: (N, K, rows) -> (BLOCK_N, blocks per tile, num_warps).
BLOCKED_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int]] = {}
# One-row (decode) tiles of the blocked GEMV for d_model 2048 / ffn 5632 matrices (seed-407m, Ouro-1.4B),
# (N, K) -> tile, chosen in the model's own kernel chain (a coordinate-descent sweep, in git history of the bench,
# each matrix's tile timed as seed-407m's decode of 64 tokens at 8 loops after a 128-token prompt; H200,
# confirmed by a second run): alone, one shape timed back to
# back, most tiles tie within a few percent, but within a decode step, where each GEMV follows a different
# kernel, the best tile of one matrix depends on its neighbours'. With the attention tile above, this
# set took those 64 tokens from 97.3 ms (the previous tiles) to 84.5-89.0 ms; the attention output's tile
# ties with (4, 32, 8) and (2, 32, 4) within 0.4 %.
BLOCKED_TILES: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 2048): (4, 8, 2),  # qkv
    (2048, 2048): (4, 16, 4),  # attention output
    (5632, 2048): (4, 8, 2),  # gate / up (SwiGLU: 2 weight rows per output feature)
    (2048, 5632): (4, 32, 8),  # down
    (32000, 2048): (4, 8, 2),  # head
}
# Register cap for the decode GEMVs (Triton and Gluon; ptxas maxnreg), or None. Nsight Compute on the H200 (
# bench/gemv_ncu.py): the (4, 8, 2) tile took 89 registers, so 10 programs fit an SM and seed-407m's QKV GEMV
# (1,536 programs) ran in 1.16 waves with 70 % of issue slots used while active. Off: on the Gluon GEMV every cap
# tried spilled and lost (64 tokens 75 ms uncapped, 91 / 130 / 176 ms at
# 128 / 96 / 80 registers).
GEMV_MAX_REGISTERS: int | None = None


def _register_cap() -> dict[str, int]:
    return {"maxnreg": GEMV_MAX_REGISTERS} if GEMV_MAX_REGISTERS else {}


# One-row GEMVs of blocked INT4 weights (64-column groups) through the Gluon kernel (kernels/gluon_gemv.py)
# instead of the Triton one; kernels/cuda_backend.py sets it where the installed Triton builds Gluon and
# TINYLOOP_DISABLE_GLUON_GEMV is unset.
USE_GLUON_GEMV = False
# (N, K, act) -> (rows per thread, lanes along rows, blocks per thread, warps along rows, warps along blocks);
# filled by benchmark sweeps to override `_gluon_tile`.
GLUON_TILES: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {}


# One-row tiles of the Gluon GEMV for d_model 2048 / ffn 5632 matrices (seed-407m, Ouro-1.4B), chosen in the
# model's own kernel chain (a coordinate-descent sweep, in git history of the bench: seed-407m decode of 64 tokens at
# 8 loops after a 128-token prompt; H200): 82.1 ms with the tiles that won
# alone (qkv and gate / up (4, 1, 1, 1, 1)) -> 76.1 ms. Alone, back to back under PDL, one
# kernel's prologue overlaps the previous one's tail, which flatters tiles with few, large programs.
GLUON_CHAIN_TILES: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    (6144, 2048, ACT_NONE): (4, 1, 1, 4, 1),  # qkv (76.46 ms; (4, 1, 1, 2, 1) 76.47)
    (2048, 2048, ACT_NONE): (4, 1, 1, 2, 2),  # attention output
    (5632, 2048, ACT_SWIGLU): (2, 2, 1, 2, 1),  # gate / up
    (2048, 5632, ACT_NONE): (4, 1, 1, 2, 2),  # down (every other tile 85-113 ms)
}


def _gluon_tile(n: int, k: int, act: int) -> tuple[int, int, int, int, int]:
    if (n, k, act) in GLUON_TILES:
        return GLUON_TILES[(n, k, act)]
    if (n, k, act) in GLUON_CHAIN_TILES:
        return GLUON_CHAIN_TILES[(n, k, act)]
    # Elsewhere the winners alone (H200, seed-407m shapes, µs against the
    # Triton GEMV): qkv (4, 1, 1, 1, 1) 4.9 vs 8.6, out (4, 1, 1, 2, 2) 2.6 vs 3.0, gate / up (4, 1, 1, 1, 1)
    # 7.0 vs 8.9, down (4, 1, 1, 2, 2) 5.2 vs 6.9, head (8, 1, 1, 1, 1) 16.6 vs 24.4 (also best in the chain).
    if n >= 16384:
        return 8, 1, 1, 1, 1
    if k < 1024:  # few 64-column blocks (the built-in model: 6): 8 lanes along blocks, not 16 or 32
        return (2 if act == ACT_SWIGLU else 4), 2, 1, 2, 1
    if n <= 2048 or k >= 4096:
        return 4, 1, 1, 2, 2
    return 4, 1, 1, 1, 1


def _gemv_gluon(x: torch.Tensor, w: BlockedInt4Weight, out: torch.Tensor, res: torch.Tensor, nw: torch.Tensor,
                b: torch.Tensor, eps: float, flags: dict) -> bool:  # fmt: skip
    """Launches the Gluon GEMV; False (once, after saying why) where this Triton's Gluon cannot build it."""
    global USE_GLUON_GEMV
    from triton.compiler.errors import CompilationError

    from tinyloop.kernels.gluon_gemv import PRMT_HIGH_BYTE, _gemv_int4_gluon_kernel

    N, K = out.shape[1], x.shape[1]
    rows, lanes_rows, per_thread, warps_rows, warps_blocks = _gluon_tile(N, K, flags["ACT"])
    block_n = rows * lanes_rows * warps_rows
    blocks = per_thread * (16 // lanes_rows) * warps_blocks
    even = N % block_n == 0 and (K // 64) % blocks == 0
    try:
        _gemv_int4_gluon_kernel[(triton.cdiv(N, block_n),)](
            x, w.packed.view(torch.int32), w.scale, w.minimum, out, res, nw, b, N, K, eps, K // 8, K // 64,
            PRMT_HIGH_BYTE, NORM=flags["NORM"], BIAS=flags["BIAS"], ACT=flags["ACT"], RESIDUAL=flags["RESIDUAL"],
            R=rows, LR=lanes_rows, BPT=per_thread, WR=warps_rows, WB=warps_blocks, EVEN=even,
            num_warps=warps_rows * warps_blocks, **_register_cap(),
            **_gluon_pdl(GLUON_LAUNCH_DEPENDENTS, "GLUON_LAUNCH_DEPENDENTS"),
        )  # fmt: skip
    except CompilationError as exc:
        USE_GLUON_GEMV = False
        info(f"the Gluon decode GEMV does not build with Triton {triton.__version__} ({exc}); using the Triton one")
        return False
    return True


# One-row GEMVs that stage their whole weight slice in shared memory by TMA before waiting for the previous
# kernel (kernels/gluon_gemv_staged.py): the decode chain's weight reads overlap the kernel before. Set by
# kernels/cuda_backend.py on Hopper and later with a Triton that builds it, unless TINYLOOP_DISABLE_STAGED_GEMV.
USE_STAGED_GEMV = False
# Under PDL the staged kernel lets the next kernel launch "after_wait" (right after its own wait), "before_wait",
# or "at_end" (after its stores: the next kernel's programs then never share an SM with its arithmetic). After
# the wait, the next GEMV stages its weights while this one computes, and no further: before it, every kernel up
# to the next attention launched at once and staged together (1,328 µs per step).
STAGED_LAUNCH_DEPENDENTS = "after_wait"
# The same choice for the streaming Gluon GEMV ("after_wait" or "at_end").
GLUON_LAUNCH_DEPENDENTS = "after_wait"
# The (N, K, act) shapes that take the staged GEMV where it is on; None: every shape its plan applies to.
# H200, seed-407m, 64 raw decode steps at 8 loops, split attention on: QKV and gate / up staged
# 75.0-75.3 ms against 76.3-76.7 with none (fresh models alternated three times, identical tokens); all four
# 75.2-75.4, QKV alone 79.7-79.9. Other shapes: not measured, so not
# staged (the decode chain is where alone-timings mislead).
STAGED_SHAPES: frozenset[tuple[int, int, int]] | None = frozenset({(6144, 2048, 0), (5632, 2048, 1)})
# (rows per thread, warps, register cap or 0) of the staged GEMV: rows per thread x warps = TILE_ROWS. The
# cap matters where a program's registers would keep the next kernel's program off the SM.
STAGED_LAYOUT = (2, 8, 0)
# The staged (N, K, act) shapes whose 16-bit x takes the staged GEMV's tensor-core variant
# (kernels/gluon_gemv_staged_mma.py) where it applies; None: every staged shape, empty: none. None: on the H200
# it lost in the decode chain in every version tried: the first version's QKV 6.4
# against 4.6 µs alone, 64 raw decode steps 88.4-89.6 ms with QKV and gate / up on it against 74.9-75.3.
STAGED_MMA_SHAPES: frozenset[tuple[int, int, int]] | None = frozenset()
# Its programs per SM (its ~50 registers a thread leave room for more than the CUDA-core kernel's one program):
# 3 took gate / up from 11.1 to 9.1 µs alone but did not move the chain.
STAGED_MMA_PROGRAMS_PER_SM = 1


def _gluon_pdl(launch: str, name: str) -> dict[str, int | bool]:
    """The Gluon GEMVs' PDL options for a launch-dependents setting (`name` is the setting's, for the error):
    `_pdl`'s, with PDL 3 (the next kernel launches at the end) for "at_end"."""
    if launch not in ("after_wait", "before_wait", "at_end"):
        raise ValueError(f"{name} is {launch!r}: expected after_wait, before_wait or at_end")
    options = _pdl(launch == "before_wait")
    if options["PDL"] and launch == "at_end":
        options["PDL"] = 3
    return options


def _staged_pdl() -> dict[str, int | bool]:
    return _gluon_pdl(STAGED_LAUNCH_DEPENDENTS, "STAGED_LAUNCH_DEPENDENTS")


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _gemv_staged(x: torch.Tensor, w: BlockedInt4Weight, out: torch.Tensor, res: torch.Tensor, nw: torch.Tensor,
                 b: torch.Tensor, eps: float, flags: dict) -> bool:  # fmt: skip
    """Launches the staged GEMV; False where its plan does not apply (or, once, where it does not build)."""
    global USE_STAGED_GEMV
    from triton.compiler.errors import CompilationError
    from triton.experimental.gluon.language import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tinyloop.kernels import gluon_gemv_staged_mma as staged_mma
    from tinyloop.kernels.gluon_gemv import PRMT_HIGH_BYTE
    from tinyloop.kernels.gluon_gemv_staged import (
        CHUNK_BLOCKS,
        TILE_ROWS,
        _gemv_int4_staged_kernel,
        staged_plan,
    )

    N, K = out.shape[1], x.shape[1]
    if STAGED_SHAPES is not None and (N, K, flags["ACT"]) not in STAGED_SHAPES:
        return False
    words = w.packed.view(torch.int32)
    aligned = all(t.data_ptr() % 16 == 0 for t in (words, w.scale, w.minimum))
    if not (aligned and words.is_contiguous() and w.scale.is_contiguous() and w.minimum.is_contiguous()):
        return False
    mma_shape = STAGED_MMA_SHAPES is None or (N, K, flags["ACT"]) in STAGED_MMA_SHAPES
    mma = mma_shape and staged_mma.applies(N, K, x.element_size())
    slots = _sm_count(x.device.index or 0) * (STAGED_MMA_PROGRAMS_PER_SM if mma else 1)
    plan = staged_plan(N, K, flags["ACT"], slots, w.scale.element_size())
    if plan is None:
        return False
    rows, blocks = words.shape[0], K // 64
    word_layout = NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    group_layout = NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * w.scale.element_size(), rank=2)
    w_desc = TensorDescriptor(words, [rows, blocks, 8], [blocks * 8, 8, 1], [TILE_ROWS, CHUNK_BLOCKS, 8], word_layout)
    s_desc, m_desc = (TensorDescriptor(t, [rows, blocks], [blocks, 1], [TILE_ROWS, CHUNK_BLOCKS], group_layout)
                      for t in (w.scale, w.minimum))  # fmt: skip
    common = dict(NORM=flags["NORM"], BIAS=flags["BIAS"], ACT=flags["ACT"], RESIDUAL=flags["RESIDUAL"],
                  TILES=plan.tiles, KCH=plan.chunks, **_staged_pdl())  # fmt: skip
    try:
        if mma:
            staged_mma._gemv_int4_staged_mma_kernel[(plan.programs,)](
                x, w_desc, s_desc, m_desc, out, res, nw, b, N, K, eps, GROUPS=blocks // staged_mma.STEP_BLOCKS,
                FP16=x.dtype == torch.float16, num_warps=staged_mma.WARPS, **common,
            )  # fmt: skip
        else:
            _gemv_int4_staged_kernel[(plan.programs,)](
                x, w_desc, s_desc, m_desc, out, res, nw, b, N, K, eps, PRMT_HIGH_BYTE,
                R=STAGED_LAYOUT[0], WR=STAGED_LAYOUT[1], num_warps=STAGED_LAYOUT[1], **common,
                **({"maxnreg": STAGED_LAYOUT[2]} if STAGED_LAYOUT[2] else {}),
            )  # fmt: skip
    except CompilationError as exc:
        USE_STAGED_GEMV = False
        info(f"the staged decode GEMV does not build with Triton {triton.__version__} ({exc}); not using it")
        return False
    return True


def _gemv_one_row_gluon(x: torch.Tensor, w: BlockedInt4Weight, out: torch.Tensor, res: torch.Tensor,
                        nw: torch.Tensor, b: torch.Tensor, eps: float, flags: dict) -> bool:  # fmt: skip
    """The staged GEMV where it is on and its plan applies, else the plain Gluon one where it is on; False:
    neither ran (the Triton kernel then does)."""
    if USE_STAGED_GEMV and _gemv_staged(x, w, out, res, nw, b, eps, flags):
        return True
    return USE_GLUON_GEMV and _gemv_gluon(x, w, out, res, nw, b, eps, flags)


def _gluon_applies(x: torch.Tensor, w: BlockedInt4Weight, M: int) -> bool:
    """What both Gluon GEMVs (plain and staged) are written for: one row, 64-column groups, on CUDA."""
    return M == 1 and w.group_size == 64 and x.shape[1] % 64 == 0 and x.is_cuda


# The same for the blocked INT4 split-K kernel: (N, K, rows) -> (BLOCK_N, BLOCK_M, BLOCK_K, num_warps).
GEMM_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}
# The same for `_gemm_blocked_int4_kernel`: (N, K, rows rounded up to a power of two) -> (BLOCK_N, BLOCK_M,
# BLOCK_K, num_warps, num_stages, splits).
INT4_GEMM_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, int, int]] = {}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for every tensor-core launch, or None: heuristic.
MATMUL_CONFIG: tuple[int, int, int, int, int] | None = None


# Programmatic dependent launch (Hopper and later; kernels/cuda_backend.py sets it, TINYLOOP_DISABLE_PDL=1
# keeps it off): the fused decode's kernels start while the previous one finishes and wait for its
# results in-kernel (GEMVs fetch their first weight tile before the wait).
USE_PDL = False


# With it, each kernel lets the next one launch before its own wait (triton_pdl: PDL = 2). Off: on the
# H200 it decoded the same tokens 1.2 % faster (176.0 vs 178.2 ms for 128 tokens, within run-to-run noise),
# not enough to give up the simpler ordering.
PDL_EARLY_LAUNCH = False


def _pdl(early: bool | None = None) -> dict[str, int | bool]:
    """Launch options for the PDL chain; `early` (default PDL_EARLY_LAUNCH): let the next kernel launch
    before this one's wait."""
    if not USE_PDL:
        return {"PDL": 0}
    return {"PDL": 2 if (PDL_EARLY_LAUNCH if early is None else early) else 1, "launch_pdl": True}


# TINYLOOP_DISABLE_CUBLAS_FP16=1 clears this (kernels/cuda_backend.py): 16-bit weights then go through
# the Triton kernels at every size instead of cuBLAS.
USE_CUBLAS_16BIT = True


def _matvec_config(n: int, k: int, rows: int, group: int) -> tuple[int, int, int]:
    if (n, k, rows) in MATVEC_CONFIGS:
        return MATVEC_CONFIGS[(n, k, rows)]
    # Tiles of the plain-layout INT4 GEMV that the blocked one replaced (H200, seed-407m shapes;
    # docs/BENCHMARKS.md); this kernel now serves 16-bit weights and INT4 outside an engine.
    if rows == 1:
        return (4, max(group, 2048), 4) if n <= 2048 else (4, max(group, 1024), 4)
    return 4, max(group, 512), 4


def _blocked_config(n: int, k: int, rows: int) -> tuple[int, int, int]:
    if (n, k, rows) in BLOCKED_CONFIGS:
        return BLOCKED_CONFIGS[(n, k, rows)]
    if rows == 1 and (n, k) in BLOCKED_TILES:
        return BLOCKED_TILES[(n, k)]
    # Winners of tile sweeps on an H200 (seed-407m shapes).
    if rows == 1:
        if n >= 16384:
            return 8, 8, 4  # the vocabulary head
        return (4, 32, 8) if k >= 4096 else (4, 16, 4)
    return (2, 8, 1) if n >= 4096 else (8, 16, 4)


def _gemm_config(n: int, k: int, rows: int) -> tuple[int, int, int, int]:
    if (n, k, rows) in GEMM_CONFIGS:
        return GEMM_CONFIGS[(n, k, rows)]
    # Winners of a tile sweep on an H200 at 5-16 rows (seed-407m shapes).
    block_m = 16 if rows <= 16 else 64
    return (32, block_m, 256, 4) if n <= 2048 and k <= 2048 else (64, block_m, 128, 4)


def _int4_gemm_config(n: int, k: int, rows: int) -> tuple[int, int, int, int, int, int]:
    bucket = triton.next_power_of_2(rows)
    if (n, k, bucket) in INT4_GEMM_CONFIGS:
        return INT4_GEMM_CONFIGS[(n, k, bucket)]
    # The most frequent winner of a tile sweep (H200, seed-407m shapes, 32-128 rows,
    # all four shapes): 64 weight rows x 128 columns per step, 4 warps, 3 stages, K split in four.
    return 64, min(128, max(16, bucket)), 128, 4, 3, 4


def int4_rows_on_cublas(rows: int) -> bool:
    """Whether `rows` rows times a blocked INT4 matrix go to dequantize + cuBLAS."""
    return USE_CUBLAS_16BIT and rows > max(BLOCKED_GEMM_MAX_ROWS, INT4_GEMM_MAX_ROWS)


def _matmul_config(m: int, n: int, group: int) -> tuple[int, int, int, int, int]:
    block_m = 16 if m <= 16 else (32 if m <= 64 else 64)
    return block_m, 64 if n >= 4096 else 32, max(group, 64), 4, 3


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
    x: torch.Tensor,
    w: Weight,
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
    words, scale, minimum, group, is_int4 = _weight_parts(w)
    blocked = isinstance(w, BlockedInt4Weight)
    int4_cublas = int4_rows_on_cublas(M) if blocked else USE_CUBLAS_16BIT and M > DOT_MAX_ROWS
    dense_cublas = not is_int4 and USE_CUBLAS_16BIT and M > MATVEC_MAX_ROWS
    if (is_int4 and int4_cublas) or dense_cublas:
        return _linear_unfused(x, w, norm_weight, eps, bias, act, residual, out)
    res = residual if residual is not None else out
    nw = norm_weight if norm_weight is not None else out
    b = bias if bias is not None else out
    flags = dict(
        GROUP=group, INT4=is_int4, NORM=norm_weight is not None, BIAS=bias is not None, ACT=act,
        RESIDUAL=residual is not None,
    )  # fmt: skip
    args = (x, words, scale, minimum, out, res, nw, b, M, N, K, eps, x.stride(0), out.stride(0), res.stride(0))
    if isinstance(w, BlockedInt4Weight):
        del flags["INT4"]
        if _gluon_applies(x, w, M) and _gemv_one_row_gluon(x, w, out, res, nw, b, eps, flags):
            return out
        if M <= MATVEC_MAX_ROWS:
            block_n, block_b, warps = _blocked_config(N, K, M)
            _gemv_blocked_int4_kernel[(triton.cdiv(N, block_n),)](
                *args, K // 8, K // group, **flags, BLOCK=w.block, ROWS=triton.next_power_of_2(M), BLOCK_N=block_n,
                BLOCK_B=block_b, num_warps=warps, **_register_cap(), **_pdl(),
            )  # fmt: skip
            return out
        return _splitk_linear(x, w, nw, eps, flags, out, res, b)
    if M <= MATVEC_MAX_ROWS:
        block_n, block_k, warps = _matvec_config(N, K, M, group)
        rows = triton.next_power_of_2(M)
        _matvec_kernel[(triton.cdiv(N, block_n),)](
            *args, **flags, ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps
        )
        return out
    block_m, block_n, block_k, warps, stages = MATMUL_CONFIG or _matmul_config(M, N, group)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _matmul_kernel[grid](
        *args, **flags, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCKED=_block_width(w), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _splitk_linear(
    x: torch.Tensor,
    w: BlockedInt4Weight,
    nw: torch.Tensor,
    eps: float,
    flags: dict,
    out: torch.Tensor,
    res: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """Float32 partial products over K splits (`_splitk_blocked_int4_kernel` for a few rows,
    `_gemm_blocked_int4_kernel` from BLOCKED_GEMM_MAX_ROWS + 1 on), `_splitk_epilogue_kernel` to finish."""
    M, K = x.shape
    n_total, N = w.shape[0], out.shape[1]
    pipelined = M > BLOCKED_GEMM_MAX_ROWS
    if pipelined:
        block_n, block_m, block_k, warps, stages, splits = _int4_gemm_config(N, K, M)
    else:
        block_n, block_m, block_k, warps = _gemm_config(N, K, M)
    block_k = max(block_k, w.group_size)
    n_tiles, m_tiles, k_tiles = triton.cdiv(n_total, block_n), triton.cdiv(M, block_m), triton.cdiv(K, block_k)
    if not pipelined:
        stages, splits = 0, max(1, SPLITK_PROGRAMS // (n_tiles * m_tiles))
    k_per_split = triton.cdiv(k_tiles, min(k_tiles, splits)) * block_k
    splits = triton.cdiv(K, k_per_split)
    part = torch.empty((splits, M, n_total), dtype=torch.float32, device=x.device)
    words = w.packed.view(torch.int32)
    args = (x, words, w.scale, w.minimum, nw, part, M, n_total, K, k_per_split, x.stride(0), K // 8, K // w.group_size)
    tile = dict(
        GROUP=w.group_size, BLOCK=w.block, NORM=flags["NORM"], IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **_pdl(),
    )  # fmt: skip
    if pipelined:
        _gemm_blocked_int4_kernel[(n_tiles, splits, m_tiles)](*args, **tile, num_stages=stages)
    else:
        _splitk_blocked_int4_kernel[(n_tiles, splits, m_tiles)](*args, **tile)
    block = min(1024, triton.next_power_of_2(N))
    _splitk_epilogue_kernel[(M, triton.cdiv(N, block))](
        x, part, out, res, b, M, N, K, splits, eps, x.stride(0), out.stride(0), res.stride(0), NORM=flags["NORM"],
        BIAS=flags["BIAS"], ACT=flags["ACT"], RESIDUAL=flags["RESIDUAL"], BLOCK=block, num_warps=4, **_pdl(),
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


class DenseReuse:
    """Dense copies of chosen INT4 weights, made on first use by a many-row matmul and kept until the
    scope that owns them ends (`dense_weights_reused`)."""

    def __init__(self, weights: Iterable[Weight]) -> None:
        self.keep = {id(w) for w in weights if isinstance(w, Int4Weight)}
        self.dense: dict[int, tuple[Weight, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for _, d in self.dense.values())


_DENSE_REUSE = threading.local()  # .scope: the calling thread's innermost DenseReuse, if any


@contextmanager
def dense_weights_reused(weights: Iterable[Weight]) -> Iterator[DenseReuse]:
    """Within the scope (per thread), a many-row (cuBLAS) matmul dequantizes each of `weights` once and
    reuses the copy: a prefill through a looped body otherwise dequantizes every body matrix once per loop
    (H200, seed-407m, 128 tokens at 8 loops: 1.5 of 4.4 ms of kernel time). The copies are freed when it
    ends."""
    outer = getattr(_DENSE_REUSE, "scope", None)
    scope = _DENSE_REUSE.scope = DenseReuse(weights)
    try:
        yield scope
    finally:
        _DENSE_REUSE.scope = outer


def _dense_weight(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """w as a dense [N, K] tensor in `dtype` (INT4 dequantized, or reused from the active scope)."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    if not isinstance(w, Int4Weight):
        raise TypeError(f"the CUDA kernels take INT4 or 16-bit weights, got {type(w).__name__}")
    scope: DenseReuse | None = getattr(_DENSE_REUSE, "scope", None)
    if scope is None or id(w) not in scope.keep:
        return dequantize_int4(w, dtype)
    hit = scope.dense.get(id(w))
    if hit is None or hit[1].dtype != dtype:
        hit = scope.dense[id(w)] = (w, dequantize_int4(w, dtype))
    return hit[1]


def _linear_unfused(
    x: torch.Tensor,
    w: Weight,
    norm_weight: torch.Tensor | None,
    eps: float,
    bias: torch.Tensor | None,
    act: int,
    residual: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Many rows: the product in one GEMM launch (`_product`), with the residual sum in the GEMM and SwiGLU in
    one launch after it."""
    h = rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    b = None if bias is None else bias.to(x.dtype)
    plain_epilogue = act == ACT_NONE and out.dtype == x.dtype
    if plain_epilogue and (residual is None or (b is None and residual.dtype == x.dtype)):
        return _product(h, w, b, residual, out)
    y = _product(h, w, b, None, None)
    if act == ACT_SWIGLU and residual is None:
        M, N = out.shape
        block = min(1024, triton.next_power_of_2(N))
        _swiglu_kernel[(M, triton.cdiv(N, block))](
            y, out, N, y.stride(0), out.stride(0), BLOCK=block, num_warps=4, **_pdl()
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
    h: torch.Tensor, w: Weight, b: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """h @ w.T (+ b) (+ residual: only without b), accumulated in float32 and rounded once, into `out` (or a
    new tensor): the Gluon INT4 GEMM where it applies, else cuBLAS on the weight in h's dtype (INT4 dequantized
    into scratch, or taken from the dense-weight reuse scope)."""
    if residual is not None and b is not None:
        raise ValueError("_product fuses a bias or a residual, not both")
    gluon = isinstance(w, BlockedInt4Weight) and _gluon_gemm_applies(h, w)
    if out is None and (gluon or residual is not None):
        out = torch.empty((h.shape[0], w.shape[0]), dtype=h.dtype, device=h.device)
    if gluon:
        assert out is not None and isinstance(w, BlockedInt4Weight)
        return _gemm_int4_gluon(h, w, b, residual, out)
    dense = _dense_weight(w, h.dtype)
    if out is None:
        return F.linear(h, dense, b)
    if residual is not None:
        return torch.addmm(residual, h, dense.t(), out=out)
    if b is not None:
        return torch.addmm(b, h, dense.t(), out=out)
    return torch.mm(h, dense.t(), out=out)


# Rows of a blocked INT4 product that go to the Gluon INT4 GEMM (kernels/gluon_gemm_int4.py) instead of
# dequantize + cuBLAS, where USE_GLUON_GEMM (Hopper, a Triton whose Gluon has wgmma) is set; up to
# GLUON_GEMM_MAX_ROWS rows (beyond, cuBLAS's compute-bound tiles win).
USE_GLUON_GEMM = False
GLUON_GEMM_MAX_ROWS = 512
# Only products whose K is at least this many times N (0: all): where cuBLAS splits K into extra launches (a
# memset, the split GEMM, a reduction, and a copy for the residual) and the Gluon kernel splits it in one.
GLUON_GEMM_MIN_K_OVER_N = 0.0
# (N, K, rows rounded up to a power of two) -> (BLOCK_M, BLOCK_N, warps, stages, split_k): BLOCK_N weight rows
# (64, 128 or 256) times BLOCK_M rows of x per program. Filled by benchmark sweeps; split_k 0 picks enough K
# splits to give every SM a program.
GLUON_GEMM_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {}


def _gluon_gemm_config(n: int, k: int, rows: int) -> tuple[int, int, int, int, int]:
    key = (n, k, triton.next_power_of_2(rows))
    if key in GLUON_GEMM_CONFIGS:
        return GLUON_GEMM_CONFIGS[key]
    return (64 if rows <= 64 else 128), 64, 4, 4, 0


def _gluon_gemm_split(tiles: int, groups: int, split_k: int, sms: int) -> int:
    """K splits per output tile: `split_k`, or (0) as many as fill `sms` SMs with at least 4 groups each; never
    one that leaves a split without a group (every split must arrive at the tile's counter)."""
    if split_k <= 0:
        split_k = max(1, min(sms // max(tiles, 1), groups // 4))
    split_k = max(1, min(split_k, groups))
    while split_k > 1 and (split_k - 1) * triton.cdiv(groups, split_k) >= groups:
        split_k -= 1
    return split_k


# Split-K scratch per device: a float32 workspace (zero between calls) and per-tile arrival counters (zero
# between calls); each call's last program per tile restores both. Grown outside CUDA graph capture only.
_GLUON_GEMM_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _gluon_gemm_scratch(device: torch.device, elements: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    have = _GLUON_GEMM_SCRATCH.get(device)
    if have is not None and have[0].numel() >= elements and have[1].numel() >= tiles:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    ws_size = max(elements, have[0].numel() if have else 0)
    count_size = max(tiles, have[1].numel() if have else 0)
    have = (torch.zeros(ws_size, dtype=torch.float32, device=device),
            torch.zeros(count_size, dtype=torch.int32, device=device))  # fmt: skip
    _GLUON_GEMM_SCRATCH[device] = have
    return have


def _gluon_gemm_applies(h: torch.Tensor, w: BlockedInt4Weight) -> bool:
    M, K = h.shape
    if not USE_GLUON_GEMM or M > GLUON_GEMM_MAX_ROWS or K < GLUON_GEMM_MIN_K_OVER_N * w.shape[0]:
        return False  # the common case (off): nothing else to look at on every prefill product
    from tinyloop.kernels import gluon_gemm_int4

    aligned = h.is_contiguous() and h.data_ptr() % 16 == 0 and w.packed.data_ptr() % 16 == 0
    return aligned and w.packed.is_contiguous() and gluon_gemm_int4.applies(K, w.group_size, h.element_size())


def _gemm_int4_gluon(
    h: torch.Tensor, w: BlockedInt4Weight, b: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """Launches kernels/gluon_gemm_int4.py: out = h @ w.T (+ b) (+ residual)."""
    from triton.experimental.gluon.language import NVMMASharedLayout, bfloat16, float16, int32
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tinyloop.kernels.gluon_gemm_int4 import GROUP_SIZE, _gemm_int4_kernel

    M, K = h.shape
    N = w.shape[0]
    block_m, block_n, warps, stages, split_k = _gluon_gemm_config(N, K, M)
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    sms = _sm_count(h.device.index or 0) if h.is_cuda else 1
    split_k = _gluon_gemm_split(tiles, K // GROUP_SIZE, split_k, sms)
    scratch = _gluon_gemm_scratch(h.device, M * N, tiles) if split_k > 1 else None
    if scratch is None:
        split_k = 1
        scratch = (out, out)
    x_dtype = bfloat16 if h.dtype == torch.bfloat16 else float16
    x_layout = NVMMASharedLayout.get_default_for([block_m, GROUP_SIZE], x_dtype)
    w_layout = NVMMASharedLayout.get_default_for([block_n, GROUP_SIZE // 8], int32)
    words = w.packed.view(torch.int32)
    x_desc = TensorDescriptor(h, [M, K], [K, 1], [block_m, GROUP_SIZE], x_layout)
    w_desc = TensorDescriptor(words, [N, K // 8], [K // 8, 1], [block_n, GROUP_SIZE // 8], w_layout)
    res = residual if residual is not None else out
    _gemm_int4_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m), split_k)](
        x_desc, w_desc, w.scale, w.minimum, out, res, b if b is not None else out, scratch[0], scratch[1], M, N, K,
        out.stride(0), res.stride(0), BIAS=b is not None, RESIDUAL=residual is not None, STAGES=stages,
        SPLIT_K=split_k, num_warps=warps,
    )  # fmt: skip
    return out


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b for contiguous tensors of one shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype or not (a.is_contiguous() and b.is_contiguous()):
        return a + b
    out = torch.empty_like(a)
    n = a.numel()
    block = min(4096, triton.next_power_of_2(n))
    _add_kernel[(triton.cdiv(n, block),)](a, b, out, n, BLOCK=block, num_warps=4, **_pdl())
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, mode: int = 0
) -> torch.Tensor:
    """mode 0: norm(x); 1: residual + norm(x); 2: norm(x + residual). x [M, D]."""
    M, D = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    _rms_norm_kernel[(M,)](
        x, res, weight, out, D, eps, x.stride(0), res.stride(0), out.stride(0), MODE=mode,
        BLOCK_D=triton.next_power_of_2(D), num_warps=4 if D <= 4096 else 8, **_pdl(),
    )  # fmt: skip
    return out


def rope_store(
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
    block_r = min(ROPE_BLOCK_ROWS, triton.next_power_of_2(rows))
    _rope_store_kernel[(triton.cdiv(rows, block_r), n_heads + 2 * n_kv_heads)](
        qkv, q, k_cache, v_cache, positions, cos, sin, rows, seq, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_HEADS=n_heads, N_KV=n_kv_heads, HEAD_DIM=head_dim, INTERLEAVED=interleaved, BLOCK_R=block_r,
        num_warps=1 if block_r == 1 else 4, **_pdl(),
    )  # fmt: skip
    return q


def cached_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, seq: int
) -> torch.Tensor:
    """q [B*T, H, hd] attends to cache positions 0..positions[i] -> [B*T, H * hd]."""
    rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    out = torch.empty((rows, n_heads * head_dim), dtype=q.dtype, device=q.device)
    block, warps = _attention_tile(head_dim)
    _cached_attention_kernel[(rows, n_heads)](
        q, k_cache, v_cache, positions, out, seq, head_dim**-0.5,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_HEADS=n_heads, GROUP=n_heads // n_kv, HEAD_DIM=head_dim, BLOCK_S=block, num_warps=warps,
        **_pdl(),
    )  # fmt: skip
    return out


# One-token attention split along the keys: (splits, a power of two; keys per block; warps), or None: one
# program per (row, head). Few heads means few programs (16 for seed-407m), each walking its whole cache;
# splits put more SMs on it and the last split to finish merges the partial softmaxes
# (kernels/triton_attention.py). H200, seed-407m, 64 raw decode steps at 8 loops after a 128-token
# prompt: 75.4 ms at (4, 64, 4) against 77.4 unsplit, 79.3 at (2, 128, 4), 78.3 at
# (8, 32, 4), 77.7 at (4, 64, 8); greedy tokens identical.
SPLIT_ATTENTION: tuple[int, int, int] | None = (4, 64, 4)
# Heads narrower than this stay whole: the built-in tiny model (6 heads of 64) decoded 2,304 tokens/s at 8
# loops with (4, 64, 4) against 2,551-2,601 unsplit (fresh models alternated).
SPLIT_ATTENTION_MIN_HEAD_DIM = 128
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
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    interleaved: bool,
) -> torch.Tensor:
    """One token per sequence: `rope_store` + `cached_attention` in one launch. qkv [B, (H + 2 KVH) hd],
    positions [B] -> [B, H * hd]; the new key and value are written into the cache at `positions`."""
    rows = qkv.shape[0]
    out = torch.empty((rows, n_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    block, warps = _attention_tile(head_dim)
    splits = 1
    part = count = out
    if SPLIT_ATTENTION is not None and head_dim >= SPLIT_ATTENTION_MIN_HEAD_DIM:
        splits, block, warps = SPLIT_ATTENTION
        part, count = _split_scratch(qkv.device, rows * n_heads, splits, head_dim)
    _rope_attention_kernel[(rows, n_heads, splits)](
        qkv, k_cache, v_cache, positions, cos, sin, out, part, count, head_dim**-0.5, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_HEADS=n_heads, N_KV=n_kv_heads, HEAD_DIM=head_dim, INTERLEAVED=interleaved, BLOCK_S=block,
        SPLITS=splits, num_warps=warps, **_pdl(),
    )  # fmt: skip
    return out


def int4_rows(ids: torch.Tensor, w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """Embedding rows of an INT4 table (plain or blocked layout) for token ids [...] -> [..., D] in `dtype`,
    in one launch."""
    D = w.shape[1]
    flat = ids.reshape(-1)
    out = torch.empty((flat.numel(), D), dtype=dtype, device=ids.device)
    if flat.numel():
        block = min(1024, triton.next_power_of_2(D))
        _int4_rows_kernel[(flat.numel(), triton.cdiv(D, block))](
            flat, w.packed, w.scale, w.minimum, out, D, w.packed.stride(0), w.scale.stride(0),
            GROUP=w.group_size, BLOCKED=isinstance(w, BlockedInt4Weight), BLOCK=block, num_warps=4, **_pdl(),
        )  # fmt: skip
    return out.view(*ids.shape, D)
