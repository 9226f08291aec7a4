"""The fused one-token attention + output projection kernel (kernels/triton_attention_out.py) compiled offline for
sm_90 (no GPU, no torch): registers, stack and SASS instructions of its loops per tile.

    <python with the GPU's Triton> bench/attention_out_sass.py [--tiles 64,256,4 64,128,4 ...]

Specialised as seed-407m's launch would be (16 heads of 128, INT4 groups of 64, bfloat16, with the residual, PDL);
tiles are KernelPolicy.attention_out_tile: keys per block, output rows per program, warps.
"""

from __future__ import annotations

import argparse
from typing import Any

from persistent_mlp_sass import _loops, kernel_module, resources_and_sass

HEADS, HEAD_DIM, GROUP = 16, 128, 64
POINTERS = {"qkv_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*fp16", "m_ptr": "*fp16", "heads_ptr": "*fp32",
            "part_ptr": "*fp32", "count_ptr": "*i32", "out_ptr": "*bf16", "res_ptr": "*bf16"}  # fmt: skip


def compile_tile(tile: str) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = kernel_module("tinyloop.kernels.triton_attention_out")._attention_out_kernel
    keys, rows, warps = (int(v) for v in tile.split(","))
    constants = dict(N_HEADS=HEADS, N_KV=HEADS, HEAD_DIM=HEAD_DIM, INTERLEAVED=False, BLOCK_S=keys, GROUP=GROUP,
                     BLOCK=min(GROUP, 64), BLOCK_N=rows, HEADS_P2=HEADS, RESIDUAL=True, PDL=2)  # fmt: skip
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = POINTERS.get(name, "fp32" if name == "scale" else "i32")
            attrs[(index,)] = [["tt.divisibility", 16]]  # pointers aligned, sizes and strides multiples of 16
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()},
                       attrs=attrs)  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    usage, sass = resources_and_sass(compiled)
    return {"tile": tile, **usage, "loops": _loops(sass)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiles", nargs="+", default=["64,256,4", "64,128,4", "64,256,8", "32,256,4", "128,512,8"])
    for tile in ap.parse_args().tiles:
        res = compile_tile(tile)
        loops = "; ".join(f"{loop['instructions']} instructions, {loop['barriers']} barriers" for loop in res["loops"])
        print(f"{tile}: {res['registers']} registers, {res['local_bytes']} bytes local; loops: {loops}")


if __name__ == "__main__":
    main()
