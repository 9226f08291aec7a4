"""Which CUDA kernel runs where: one frozen `KernelPolicy`, built when an engine is created (from the
environment and the GPU) and passed to every launcher in kernels/cuda_ops.py; plus the tile rules.

Nothing here is changed at run time: a benchmark that compares choices builds one policy per choice
(`dataclasses.replace`) and a model per policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import NamedTuple

ACT_NONE, ACT_SWIGLU, ACT_GELU = 0, 1, 2
UNDER_PDL = ("after_wait", "before_wait", "at_end")

Shape = tuple[int, int, int]  # (N, K, rows) or (N, K, act)


class PersistentMlpTile(NamedTuple):
    """Work items of the persistent MLP kernel (kernels/triton_persistent_mlp.py): ffn features per gate / up
    item and 64-column blocks per step of its loop over d_model; the down projection's K slice (ffn features)
    and output rows per down item; warps per program, and programs per SM (at most what fits one SM); items
    per ticket (one ticket atomic per `tickets` items); `static`: no ticket counter, items dealt round-robin to
    the programs (all of them resident, which the launcher ensures); `x_prologue`: one item first writes x times
    the norm's gain in float32 and 1 / rms(x), which the gate / up items read instead of each converting,
    scaling and squaring x itself; `mask_in_register`: the nibble mask as a run-time value (one logic op per
    weight instead of two); `h_float32`: the SwiGLU output h (the same rounded values) kept in float32, which the
    down items load in their weights' register layout (bfloat16 h: a shared-memory shuffle per nibble);
    `prefetch_next` (Hopper and later): program p asks L2 for item p's weights before the PDL wait (the first
    wave of items) and, with `static`, for its next items' while it works on the current ones (bulk prefetch)."""

    gate_up_rows: int
    gate_up_blocks: int
    slice: int
    down_rows: int
    warps: int
    programs_per_sm: int = 1
    tickets: int = 1
    static: bool = False
    x_prologue: bool = False
    mask_in_register: bool = False
    h_float32: bool = False
    prefetch_next: bool = False


@dataclass(frozen=True)
class KernelPolicy:
    """The CUDA kernel choices of one engine. The defaults are the measured winners (docs/BENCHMARKS.md);
    `kernels.cuda_backend.kernel_policy` turns on what the GPU and the installed Triton support.

    The `*_tiles` mappings override the tile rules below per shape (benchmark sweeps); empty by default.
    """

    # 16-bit products of more than `matvec_max_rows` rows (and INT4 ones past `blocked_gemm_max_rows`) go to
    # cuBLAS; off (TINYLOOP_DISABLE_CUBLAS_FP16=1): the Triton kernels at every size.
    cublas_16bit: bool = True
    # Programmatic dependent launch (Hopper and later): each kernel starts while the previous one finishes.
    pdl: bool = False
    # Under PDL, let the next kernel launch before this one's wait. Off: 1.2 % on the H200, within noise.
    pdl_early_launch: bool = False
    # GEMVs of blocked INT4 weights through the Gluon kernel (kernels/gluon_gemv.py), for up to
    # `gluon_gemv_max_rows` rows: each weight is read and decoded once for all of them.
    gluon_gemv: bool = False
    gluon_gemv_max_rows: int = 4
    # One-row GEMVs that stage their weight slice in shared memory by TMA before the PDL wait
    # (kernels/gluon_gemv_staged.py), for the shapes `staged_applies` names.
    staged_gemv: bool = False
    # (N, K, act) shapes that take the staged GEMV; None: the rule in `staged_applies`.
    staged_shapes: frozenset[Shape] | None = None
    # (rows per thread, warps, register cap or 0) of the staged GEMV.
    staged_layout: tuple[int, int, int] = (2, 8, 0)
    # When the GEMVs let the next kernel launch under PDL: "after_wait", "before_wait" or "at_end".
    staged_launch_dependents: str = "after_wait"
    gluon_launch_dependents: str = "after_wait"
    # Register cap for the decode GEMVs (ptxas maxnreg), or None: every cap tried spilled and lost.
    gemv_max_registers: int | None = None
    # Row counts that pick the kernel: up to `matvec_max_rows` the CUDA-core GEMV; blocked INT4 takes the
    # split-K tensor-core kernel up to `blocked_gemm_max_rows`, dequantize + cuBLAS beyond.
    matvec_max_rows: int = 4
    blocked_gemm_max_rows: int = 16
    # 16-bit weights: products of more rows than this go to cuBLAS (flat in the row count on an H100, where
    # the Triton GEMV of 2-4 rows costs ~2x per row).
    matvec_16bit_max_rows: int = 1
    # Batched one-token steps of `tinygemm_min_rows` to `tinygemm_max_rows` sequences in bfloat16 multiply torch's
    # CUDA tinygemm INT4 kernel (quant.CudaTinygemmWeight: the INT4 matrices repacked on the first such step,
    # as many bytes again), where `tinygemm` is on. H100, seed-407m (docs/BENCHMARKS.md): a batch-4 step 1.94 ms
    # against 2.48 on the 16-bit copies, batch 8 2.65 against 2.73; its four layer products at 16 rows 77.2 µs
    # against 55.2 on the copies. Two rows stay on the Gluon GEMV, as fast end to end (1.66 ms a step): its four
    # products take 38.3 µs a layer against tinygemm's 33.1 with the norm, SwiGLU and residual as launches of
    # their own, which the GEMV fuses, and it keeps the one-row step's INT4 arithmetic. tinygemm dequantizes to
    # bfloat16 with bfloat16 scales and zeros: its products are off float32 by 0.3-0.75 %, against 0.2-0.6 % for
    # cuBLAS on the copies.
    # A single sequence's verification passes keep the INT4 kernels (see FusedDecoder.dense_copies).
    tinygemm: bool = False
    tinygemm_min_rows: int = 3
    tinygemm_max_rows: int = 8
    # Steps of at least this many sequences (batched decode) that tinygemm does not take, and prefill-sized ones,
    # multiply 16-bit copies of the model's INT4 matrices through cuBLAS, made on the first such step and kept
    # while the engine lives (where they fit the decoder's memory budget); 0: never. cuBLAS on the copies is flat
    # in the row count (seed-407m's four layer products 53.5 µs on an H100 at 1-64 rows): 3 rows 53.5 against
    # 58.8 on the Gluon GEMV, 8 rows against 80.9 on the split-K kernel.
    dense_copy_min_rows: int = 3
    # Batched one-token steps of `mma_int4_min_rows` (`mma_int4_wgmma_min_rows` with the warpgroup version) to
    # `mma_int4_max_rows` sequences in 16-bit compute multiply the tensor-core INT4 kernels (kernels/gluon_int4_mma.py)
    # on a copy of the INT4 matrices in their layout (quant.CudaMmaInt4Weight, as many bytes again), made on the
    # first such step, where `mma_int4` is on (Hopper or later); they take those steps before tinygemm and the 16-bit
    # copies. The mma.sync version was level with tinygemm at 4 rows on an H100 (40.2 against 39.9 µs a seed-407m
    # layer), so it starts at 8.
    mma_int4: bool = False
    mma_int4_min_rows: int = 8
    mma_int4_max_rows: int = 32
    # The mma.sync version splits K until about this many programs run (four per SM of an H100): a seed-407m step
    # of 8 rows took 2.035 ms against 2.236 at 264 programs (H100).
    mma_int4_programs: int = 528
    # Where `mma_int4_wgmma` is on (sm_90: wgmma is Hopper's alone) every product takes the warpgroup version (x
    # staged once per program in shared memory, where wgmma reads it for every warp), from
    # `mma_int4_wgmma_min_rows` to `mma_int4_wgmma_max_rows` rows, with K split until about
    # `mma_int4_wgmma_programs` programs run. Its x tiles of up to `mma_int4_wgmma_loads_ahead_max_rows` rows load
    # K tiles `mma_int4_wgmma_loads_ahead` ahead of the one multiplied under a register cap of
    # `mma_int4_wgmma_max_registers` (two 8-warp programs per SM; offline sm_90a: no spills; at 32-64 rows loading
    # ahead was slower under every cap). H100, seed-407m (docs/BENCHMARKS.md): its four layer products take
    # 31.3-31.9 µs at 2-8 rows against 38.3 on the 2-row Gluon GEMV and 41.0 on tinygemm at 4 rows. 64 rows stay on
    # the 16-bit copies: alone, the products took 55.4 µs a layer against 59.7 on cuBLAS, but a B=64 step 3.70 ms
    # against 3.52.
    mma_int4_wgmma: bool = False
    mma_int4_wgmma_min_rows: int = 2
    mma_int4_wgmma_max_rows: int = 32
    mma_int4_wgmma_programs: int = 264
    # ... but into at most `mma_int4_wgmma_split_rows` / (x rows) splits: each split writes and the tile's last
    # program reads its float32 partials (4 bytes a row a feature), as many bytes as the weights' own at 64 rows and
    # 4 splits of a 2,048-column matrix (H100, seed-407m's o at 64 rows: 4 splits 6.8 µs, 8 splits 10.9).
    mma_int4_wgmma_split_rows: int = 256
    mma_int4_wgmma_loads_ahead: int = 2
    mma_int4_wgmma_loads_ahead_max_rows: int = 16
    mma_int4_wgmma_max_registers: int = 128
    # A single sequence's steps of several tokens (speculative verification) whose row count the tensor-core kernel
    # takes run on it too: on an H100 draft 2 / verify 8 on seed-407m went from 1.18-1.25x plain to 1.41-1.55x.
    mma_int4_few_tokens: bool = True
    # Batch-invariant decoding (TINYLOOP_BATCH_INVARIANT=1; Hopper, 16-bit compute, INT4 matrices): every product of
    # any row count (one-token steps of any batch, prompt chunks, the head) runs the warpgroup INT4 kernel with one
    # tile and one K split per matrix shape, so each row is summed in the same order whatever else is in the step,
    # and every attention takes the per-query cached-attention kernel (keys in fixed blocks from position 0). A
    # sequence's logits are then the same bits alone, in any batch and however its prompt is chunked (the kernel's
    # evidence: docs/BENCHMARKS.md; the end-to-end check and the price: bench/batch_invariance.py).
    batch_invariant: bool = False
    # ... into at most this many K splits per matrix (0: as many as fill `mma_int4_wgmma_programs`): each split
    # writes float32 partials for every row, which at 64 rows and 16 splits of a 2,048-column matrix are four times
    # the weight's own bytes. Off by default: on an H100 a cap of 4 made 64-row steps 7 % faster and 1-8-row steps
    # 6-14 % slower (docs/BENCHMARKS.md).
    batch_invariant_max_splits: int = 0
    # The split-K kernel splits K until about this many programs run (two per SM of an H100/H200).
    splitk_programs: int = 264
    # Cached attention (keys per block, warps) for heads of at least 128 and for narrower heads.
    attention_tile: tuple[int, int] = (256, 8)
    narrow_head_attention_tile: tuple[int, int] = (128, 4)
    # One-token attention (`rope_attention_tile`) for heads of at least `split_attention_min_head_dim`: the keys
    # split among programs of `split_attention_tile` (keys per block, warps) until about `split_attention_programs`
    # run (at most `split_attention_max_splits` per head). H100, seed-407m's 16 heads of 128 (docs/BENCHMARKS.md):
    # one-warp programs of 32 keys at 1,024 programs took 30.7 / 19.4 / 6.5 us at 64 / 32 / 8 rows of 160 positions
    # against 60.7 / 31.1 / 8.8 for four splits of 64 keys at 4 warps, and 9.4 against 21.5 us at one row of 1,024.
    # A single row keeps `one_row_attention_tile` (splits, keys, warps) below `long_cache_keys` cached keys: 16 one-warp
    # splits made seed-407m's 128 tokens after 128 1.7 % slower end to end (162.6 against 159.9 ms, H100). From there
    # on `one_row_long_attention_tile`: one row of 1,024 / 2,048 keys 6.6 / 10.4 us against 21.5 / 44.0 (H100).
    split_attention_tile: tuple[int, int] = (32, 1)
    one_row_attention_tile: tuple[int, int, int] = (4, 64, 4)
    one_row_long_attention_tile: tuple[int, int, int] = (16, 128, 4)
    long_cache_keys: int = 512
    split_attention_programs: int = 1024
    split_attention_max_splits: int = 16
    split_attention_min_head_dim: int = 128
    # One-token attention fused with the INT4 output projection (kernels/attention_out.py; one row with
    # TINYLOOP_PERSISTENT_DECODE=1) for steps of up to `attention_out_max_rows` rows (0: never) attending to fewer
    # than `long_cache_keys` keys: a program per (head, `attention_out_tile`'s output rows) attends over its head's
    # whole cache in blocks of that tile's keys (warps).
    attention_out_max_rows: int = 0
    attention_out_tile: tuple[int, int, int] = (64, 256, 4)
    # RoPE + cache write: rows per program.
    rope_block_rows: int = 16
    # Prefill attention (SDPA) on CUDA: the math backend instead of flash (TINYLOOP_DISABLE_FLASH2_PREFILL),
    # or cuDNN (TINYLOOP_USE_CUDNN_SDPA).
    sdpa_math_only: bool = False
    sdpa_cudnn: bool = False
    # Decode steps' MLP sublayer (norm, gate / up, SwiGLU, down, residual) as one persistent kernel of work items
    # (kernels/persistent_mlp.py; TINYLOOP_PERSISTENT_DECODE=1): off until it is measured to win.
    persistent_decode: bool = False
    # Tile overrides: (N, K, rows) -> tile for the plain GEMV, the blocked GEMV and the split-K kernel;
    # (N, K, act, rows) -> tile for the Gluon GEMV.
    matvec_tiles: Mapping[Shape, tuple[int, int, int]] = field(default_factory=dict)
    blocked_tiles: Mapping[Shape, tuple[int, int, int]] = field(default_factory=dict)
    splitk_tiles: Mapping[Shape, tuple[int, int, int, int]] = field(default_factory=dict)
    gluon_tiles: Mapping[tuple[int, int, int, int], tuple[int, int, int, int, int]] = field(default_factory=dict)
    # (rows, heads, head_dim) -> (splits, keys per block, warps) of the one-token attention.
    rope_attention_tiles: Mapping[Shape, tuple[int, int, int]] = field(default_factory=dict)
    # (N, K, rows) -> (warps, row tiles per warp, BLOCK_K, x rows per program) of the tensor-core INT4 kernel.
    mma_int4_tiles: Mapping[Shape, tuple[int, int, int, int]] = field(default_factory=dict)
    # (d_model, ffn, rows) -> tile of the persistent MLP kernel.
    persistent_mlp_tiles: Mapping[Shape, PersistentMlpTile] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("staged_launch_dependents", "gluon_launch_dependents"):
            if getattr(self, name) not in UNDER_PDL:
                raise ValueError(f"KernelPolicy.{name} is {getattr(self, name)!r}: expected one of {UNDER_PDL}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_tiles") and not isinstance(value, MappingProxyType):
                # read-only copies: the policy stays a value once built
                object.__setattr__(self, f.name, MappingProxyType(dict(value)))

    # ---- launch options ------------------------------------------------------------------------------------
    def pdl_options(self, early: bool | None = None) -> dict[str, int | bool]:
        """Launch options for the PDL chain; `early` (default `pdl_early_launch`): let the next kernel launch
        before this one's wait."""
        if not self.pdl:
            return {"PDL": 0}
        return {"PDL": 2 if (self.pdl_early_launch if early is None else early) else 1, "launch_pdl": True}

    def gluon_pdl_options(self, launch: str) -> dict[str, int | bool]:
        """The Gluon GEMVs' PDL options for a launch-dependents setting: PDL 3 (the next kernel launches at
        the end) for "at_end"."""
        options = self.pdl_options(launch == "before_wait")
        if options["PDL"] and launch == "at_end":
            options["PDL"] = 3
        return options

    def register_cap(self) -> dict[str, int]:
        return {"maxnreg": self.gemv_max_registers} if self.gemv_max_registers else {}

    def rows_on_cublas(self, rows: int, kernel_max_rows: int) -> bool:
        """Whether a product of `rows` rows goes to cuBLAS rather than a kernel that takes up to `kernel_max_rows`
        (never batch invariant: cuBLAS picks its algorithm by the row count)."""
        return self.cublas_16bit and not self.batch_invariant and rows > kernel_max_rows

    def int4_rows_on_cublas(self, rows: int) -> bool:
        """Whether `rows` rows times a blocked INT4 matrix go to dequantize + cuBLAS."""
        return self.rows_on_cublas(rows, self.blocked_gemm_max_rows)

    # ---- tiles ---------------------------------------------------------------------------------------------
    def matvec_tile(self, n: int, k: int, rows: int, group: int) -> tuple[int, int, int]:
        """(BLOCK_N, BLOCK_K, warps) of the plain-layout GEMV (16-bit weights, INT4 outside an engine)."""
        if (n, k, rows) in self.matvec_tiles:
            return self.matvec_tiles[(n, k, rows)]
        if rows == 1:
            return (4, max(group, 2048), 4) if n <= 2048 else (4, max(group, 1024), 4)
        return 4, max(group, 512), 4

    def blocked_tile(self, n: int, k: int, rows: int) -> tuple[int, int, int]:
        """(BLOCK_N, blocks per tile, warps) of the blocked INT4 GEMV; see `blocked_gemv_tile`."""
        if (n, k, rows) in self.blocked_tiles:
            return self.blocked_tiles[(n, k, rows)]
        return blocked_gemv_tile(n, k, rows)

    def splitk_tile(self, n: int, k: int, rows: int) -> tuple[int, int, int, int]:
        """(BLOCK_N, BLOCK_M, BLOCK_K, warps) of the blocked INT4 split-K kernel. Winners of the gemm sweep on
        an H200 at 5-16 rows (seed-407m shapes)."""
        if (n, k, rows) in self.splitk_tiles:
            return self.splitk_tiles[(n, k, rows)]
        block_m = 16 if rows <= 16 else 64
        return (32, block_m, 256, 4) if n <= 2048 and k <= 2048 else (64, block_m, 128, 4)

    def mma_int4_tile(self, n: int, k: int, rows: int) -> tuple[int, int, int, int]:
        """(warps, row tiles of 16 weight rows per warp, BLOCK_K, x rows per program) of the tensor-core INT4
        kernel: the winners of bench/int4_mma_rows.py on an H100 (seed-407m's products, 2-64 rows). Warpgroup
        version: 8 warps of one row tile (128 weight rows), for 32 x rows 4 warps of two where N > K (qkv,
        gate / up); 64 x rows in one tile only for matrices at least 4 times as tall as wide (gate / up), in two of
        32 else. mma.sync (528 programs): two row tiles a warp for tall matrices (gate / up) from 8 rows and long
        rows (down) from 16, 256 columns a step for long rows below 8; 64 x rows only with 64 columns a step (more
        spill, sm_90a). Batch invariant: 8 warps of one row tile, 128 columns a step, at every row count."""
        if (n, k, rows) in self.mma_int4_tiles:
            return self.mma_int4_tiles[(n, k, rows)]
        rows_x = max(16, 1 << (rows - 1).bit_length())
        if self.batch_invariant:  # x tiles of 16 or 32 rows change no row's sums (measured bit-equal on an H100)
            return (8, 1, 128, min(rows_x, 32))
        if self.mma_int4_wgmma:
            if rows_x == 32 and n > k:
                return (4, 2, 128, 32)
            return (8, 1, 128, 64 if rows_x == 64 and n >= 4 * k else min(rows_x, 32))
        row_tiles = 2 if (n >= 8192 and rows >= 8) or (k >= 4096 and rows >= 16) else 1
        if rows_x == 64:
            return (4, row_tiles, 64, 64)
        if rows_x == 16 and rows < 8 and k >= 4096:
            return (4, 1, 256, 16)
        return (4, row_tiles, 128, rows_x)

    def mma_int4_takes_rows(self, rows: int) -> bool:
        """Whether a product of `rows` rows of x runs the tensor-core INT4 kernel (where a step takes it at all)."""
        if self.batch_invariant:  # every row count, one plan
            return self.mma_int4 and self.mma_int4_wgmma
        if self.mma_int4_wgmma:
            lowest, highest = self.mma_int4_wgmma_min_rows, self.mma_int4_wgmma_max_rows
        else:
            lowest, highest = self.mma_int4_min_rows, self.mma_int4_max_rows
        return self.mma_int4 and max(2, lowest) <= rows <= highest

    def gluon_tile(self, n: int, k: int, act: int, rows: int = 1) -> tuple[int, int, int, int, int]:
        """(weight rows per thread, lanes along rows, blocks per thread, warps along rows, warps along blocks)
        of the Gluon GEMV over `rows` rows of x; see `gluon_gemv_tile`."""
        if (n, k, act, rows) in self.gluon_tiles:
            return self.gluon_tiles[(n, k, act, rows)]
        return gluon_gemv_tile(n, k, act, rows)

    def persistent_mlp_tile(self, d: int, f: int, rows: int, group: int) -> PersistentMlpTile | None:
        """The persistent MLP kernel's items for d_model `d`, ffn `f`, `rows` rows and INT4 groups of `group`
        columns; None where no K slice divides the ffn. Untuned: K slices of 256 features (22 on seed-407m); one
        row: gate / up items of 32 features, down items of 128 output rows (528 items for 132 SMs); 2-4 rows: 8
        and 32, the largest that compiled without spilling at 4 rows (sm_90a, offline: 204 registers; one row's
        tile takes 255 without spilling, so one 8-warp program per SM)."""
        if (d, f, rows) in self.persistent_mlp_tiles:
            return self.persistent_mlp_tiles[(d, f, rows)]
        block = min(group, 64)
        slices = [s for s in (256, 128, 64) if f % s == 0 and s % block == 0]
        if not slices or d % block:
            return None
        one = rows == 1
        gate_up_rows = min(32 if one else 8, slices[0])
        blocks = min(8 if one else 4, 1 << (d // block - 1).bit_length())
        down_rows = min(128 if one else 32, 1 << (d - 1).bit_length())
        return PersistentMlpTile(gate_up_rows, blocks, slices[0], down_rows, 8)

    def attention_block(self, head_dim: int) -> tuple[int, int]:
        return self.attention_tile if head_dim >= 128 else self.narrow_head_attention_tile

    def attends_long_cache(self, rows: int, keys: int) -> bool:
        """Whether a one-token step of `rows` rows, the longest attending to `keys` keys, takes the long-cache
        tile in `rope_attention_tile` (only a single row's tile follows the cache's length)."""
        return rows == 1 and keys >= self.long_cache_keys

    def rope_attention_tile(
        self, rows: int, n_heads: int, head_dim: int, long_cache: bool = False
    ) -> tuple[int, int, int]:
        """(splits, keys per block, warps) of the one-token attention over `rows` rows of `n_heads` heads: the
        power of two of splits that brings the programs nearest `split_attention_programs` from below (one
        at least); one row `one_row_attention_tile`, or `one_row_long_attention_tile` where the step attends to
        `long_cache_keys` keys or more (`long_cache`); heads narrower than `split_attention_min_head_dim` whole, in
        one program each."""
        if (rows, n_heads, head_dim) in self.rope_attention_tiles:
            return self.rope_attention_tiles[(rows, n_heads, head_dim)]
        if head_dim < self.split_attention_min_head_dim:
            return (1, *self.attention_block(head_dim))
        if rows == 1:
            return self.one_row_long_attention_tile if long_cache else self.one_row_attention_tile
        wanted = min(self.split_attention_max_splits, self.split_attention_programs // max(1, rows * n_heads))
        return (1 << (max(1, wanted).bit_length() - 1), *self.split_attention_tile)

    def staged_applies(self, n: int, k: int, act: int) -> bool:
        """Whether an (N, K, act) one-row product takes the staged GEMV (where `staged_gemv` is on). Rule: the
        wide products of a layer (N > K: QKV, gate / up) of models with K >= 2048, not a vocabulary head; on
        seed-407m that is QKV and gate / up, which staged 75.0-75.3 ms against 76.3-76.7 with none (H200, 64
        decode steps at 8 loops); staging all four layer products did not help (75.2-75.4). A 2-row step staged
        (the kernel generalised to rows) took 1.713 ms against 1.659 on the plain Gluon GEMV (H100)."""
        if self.staged_shapes is not None:
            return (n, k, act) in self.staged_shapes
        return act != ACT_GELU and STAGED_MIN_K <= k < n < VOCABULARY_MIN_N


# The tile rules below generalise the tiles chosen in the model's own kernel chain on seed-407m (d_model 2048,
# ffn 5632; coordinate descent on 64 decode tokens at 8 loops; H200, docs/BENCHMARKS.md). Within a decode step
# the best tile of one matrix depends on its neighbours', so alone-timings mislead. For seed-407m and the
# built-in model (d_model 384) they return exactly the tiles those measurements chose.
VOCABULARY_MIN_N = 16384  # an N this large is a vocabulary head
STAGED_MIN_K = 2048


def blocked_gemv_tile(n: int, k: int, rows: int) -> tuple[int, int, int]:
    """One row: long K (the down projection) (4, 32, 8); wide products over 2048 <= K < 4096 (QKV, gate / up,
    the head) (4, 8, 2); other heads (8, 8, 4); the rest (attention output, small models) (4, 16, 4).
    2-4 rows: the sweep's winners by width."""
    if rows == 1:
        if k >= 4096 and n < VOCABULARY_MIN_N:
            return 4, 32, 8
        if STAGED_MIN_K <= k < min(n, 4096):
            return 4, 8, 2
        if n >= VOCABULARY_MIN_N:
            return 8, 8, 4
        return 4, 16, 4
    return (2, 8, 1) if n >= 4096 else (8, 16, 4)


def gluon_gemv_tile(n: int, k: int, act: int, rows: int = 1) -> tuple[int, int, int, int, int]:
    """One row: heads (8, 1, 1, 1, 1) (16.6 vs 24.4 µs for the Triton GEMV); few 64-column blocks (K < 1024, the
    built-in model) 8 lanes along blocks; narrow or long-K products (attention output, down) (4, 1, 1, 2, 2);
    the wide ones (QKV (4, 1, 1, 4, 1); gate / up (2, 2, 1, 2, 1)) as the chain chose them: 82.1 -> 76.1 ms
    against the tiles that won alone. More rows: `gluon_rows_tile`."""
    if rows > 1:
        return gluon_rows_tile(n, k, act, rows)
    if n >= VOCABULARY_MIN_N:
        return 8, 1, 1, 1, 1
    if k < 1024:
        return (2 if act == ACT_SWIGLU else 4), 2, 1, 2, 1
    if n <= 2048 or k >= 4096:
        return 4, 1, 1, 2, 2
    return (2, 2, 1, 2, 1) if act == ACT_SWIGLU else (4, 1, 1, 4, 1)


def gluon_rows_tile(n: int, k: int, act: int, rows: int) -> tuple[int, int, int, int, int]:
    """The Gluon GEMV's tile for 2 or more rows of x (a thread holds every row's partial sums, so fewer weight
    rows per thread as rows and SwiGLU's second half add registers): the fastest of 14 tiles per seed-407m
    product and row count (bench/gluon_gemv_rows.py, H100; the Ouro-1.4B shape has the same products), 2 rows
    wide (N > K) (4, 2, 1, 2, 1), gate / up (2, 1, 1, 4, 1), narrow or long-K (4, 1, 1, 2, 2); 3-4 rows with half
    the weight rows per thread; more rows one. Heads and the built-in model's narrow products unmeasured."""
    if k < 1024:
        return (2 if rows <= 3 else 1), 2, 1, 2, 1
    if n >= VOCABULARY_MIN_N:
        return (4 if rows == 2 else 2), 1, 1, 4, 1
    if rows > 4:
        return 1, 4, 1, 2, 2
    if act == ACT_SWIGLU:
        return (2, 1, 1, 4, 1) if rows <= 3 else (1, 4, 1, 2, 2)
    if n > k:
        return (4, 2, 1, 2, 1) if rows == 2 else (2, 2, 1, 2, rows - 2)
    return (4, 1, 1, 2, 2) if rows == 2 else (2, 1, 1, 4, 1)
