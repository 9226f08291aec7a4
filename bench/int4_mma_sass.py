"""The tensor-core INT4 kernel (kernels/gluon_int4_mma.py) compiled offline for sm_90a (no GPU, no torch) with
the kernel policy's tiles for seed-407m's four layer products: registers, shared memory, and SASS instructions
per K step of a program — which says whether a product can stream its weights at the memory's rate.

    <python with the GPU's Triton> bench/int4_mma_sass.py [--rows 8 16 32] [--json]

A program's K step multiplies one tile of weights (tile rows x BLOCK_K columns, half a byte each); its warps
issue `instructions x warps` warp instructions for those bytes. An H100 SXM SM issues at most 4 warp
instructions a cycle, and streaming 3.35 TB/s over 132 SMs at 1.98 GHz brings 12.8 bytes a cycle to each SM,
so a step needing more than ~0.31 warp instructions per weight byte cannot stream at that rate however well
its loads are spread (the scheduler never issues every cycle, so the practical bound is lower).
Runs on any Python with Triton (Gluon) and its bundled ptxas / cuobjdump; the modules are loaded from src/
without the tinyloop package (whose import needs torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from persistent_mlp_sass import _loops, kernel_module, resources_and_sass

GROUP = 64
# seed-407m's products as the decode step calls them: name -> (N, K, act, norm, residual)
SHAPES = {"qkv": (6144, 2048, 0, True, False), "o": (2048, 2048, 0, False, True),
          "gate_up": (11264, 2048, 1, True, False), "down": (2048, 5632, 0, False, True)}  # fmt: skip
ISSUE_BUDGET = 4 * 132 * 1.98e9 / 3.35e12  # warp instructions per byte at full bandwidth (H100 SXM)
# An H100 SM: 65,536 registers (given to warps in blocks of 256), 228 KiB of shared memory (1 KiB of it reserved
# per block), 64 warps, 32 blocks.
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_BLOCKS = 65536, 228 * 1024, 64, 32


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """How many programs of `warps` warps an H100 SM holds at once at `registers` a thread and `shared` bytes."""
    per_warp = -(-registers * 32 // 256) * 256
    by_shared = SM_SHARED // (shared + 1024)
    return min(SM_REGISTERS // (per_warp * warps), by_shared, SM_WARPS // warps, SM_BLOCKS)


def compile_product(mma: Any, policy: Any, name: str, rows: int, wgmma: bool = False) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    n, k, act, norm, residual = SHAPES[name]
    warps, row_tiles, block_k, rows_x = policy.mma_int4_tile(n, k, rows)
    block_n = 16 * warps * row_tiles
    kernel = mma._int4_mma_kernel
    layouts = mma.layouts(warps, row_tiles, block_k, rows_x, wgmma, GROUP)
    ahead = 2 if wgmma and rows_x <= policy.mma_int4_wgmma_loads_ahead_max_rows else 1
    constants: dict[str, Any] = dict(GROUP=GROUP, NORM=norm, BIAS=False, ACT=act, RESIDUAL=residual, BN=block_n,
                                     BK=block_k, MP=rows_x, AHEAD=ahead, PDL=2,
                                     **layouts)  # fmt: skip
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "sm_ptr": "*i32", "nw_ptr": "*bf16", "part_ptr": "*fp32",
                "squares_ptr": "*fp32", "arrivals_ptr": "*i32", "out_ptr": "*bf16", "res_ptr": "*bf16",
                "b_ptr": "*bf16"}  # fmt: skip
    divisible = {"N", "K", "stride_xm", "stride_w", "stride_g", "stride_om", "stride_rm"}
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = pointers[arg]
            if arg != "arrivals_ptr":
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32" if arg == "eps" else "i32"
            if arg in divisible:
                attrs[(index,)] = [["tt.divisibility", 16]]
    options: dict[str, Any] = {"num_warps": warps}
    if ahead == 2:
        options["maxnreg"] = policy.mma_int4_wgmma_max_registers
    compiled = triton.compile(GluonASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)  # fmt: skip
    usage, sass = resources_and_sass(compiled)
    registers, local = usage["registers"], usage["local_bytes"]
    k_step = next(loop for loop in _loops(sass) if loop["tensor_core"])  # the K loop (the finish's has no MMA)
    tile_bytes, steps = block_n * block_k // 2, k_step["instructions"]
    return {"product": name, "rows": rows, "tile": [warps, row_tiles, block_k, rows_x], "registers": registers,
            "local_bytes": local, "shared_bytes": compiled.metadata.shared, "k_step_instructions": steps,
            "k_step_barriers": k_step["barriers"], "k_step_top_opcodes": k_step["top"],
            "weight_bytes_per_step": tile_bytes,
            "warp_instructions_per_byte": round(steps * warps / tile_bytes, 3),
            "programs_per_sm": programs_per_sm(registers, compiled.metadata.shared, warps)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--json", action="store_true", help="one JSON object per product and row count")
    ap.add_argument("--wgmma", action="store_true", help="the warpgroup version (else mma.sync)")
    args = ap.parse_args()
    try:
        import triton
        from triton.experimental import gluon  # noqa: F401
    except ImportError:
        sys.exit("int4_mma_sass.py: needs Triton with Gluon (and its bundled ptxas / cuobjdump) in this Python")
    mma = kernel_module("tinyloop.kernels.gluon_int4_mma")
    policy = kernel_module("tinyloop.kernels.policy").KernelPolicy(mma_int4=True, mma_int4_wgmma=args.wgmma)
    if not args.json:
        print(f"Triton {triton.__version__}; full bandwidth allows ~{ISSUE_BUDGET:.2f} warp instructions per byte")
    for rows in args.rows:
        for name in SHAPES:
            res = compile_product(mma, policy, name, rows, args.wgmma)
            if args.json:
                print(json.dumps(res))
                continue
            print(f"{name:8s} {rows:2d} rows, tile {res['tile']}: {res['registers']} registers "
                  f"({res['local_bytes']} B local), {res['shared_bytes']} B shared, {res['programs_per_sm']} programs "
                  f"an SM; K step "
                  f"{res['k_step_instructions']} instructions a thread for {res['weight_bytes_per_step']} weight "
                  f"bytes = "
                  f"{res['warp_instructions_per_byte']} warp instructions a byte")  # fmt: skip


if __name__ == "__main__":
    main()
