import sys
from typing import Any
from persistent_mlp_sass import _loops, kernel_module, resources_and_sass
from int4_mma_sass import SHAPES, GROUP

def compile_wg(name, tile, pdl=2):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    wg = kernel_module("tinyloop.kernels.gluon_int4_wgmma")
    n, k, act, norm, residual = SHAPES[name]
    warps, row_tiles, block_k, rows_x = tile
    block_n = 16 * warps * row_tiles
    kernel = wg._int4_wgmma_kernel
    constants: dict[str, Any] = dict(GROUP=GROUP, NORM=norm, BIAS=False, ACT=act, RESIDUAL=residual, BN=block_n,
                                     BK=block_k, MP=rows_x, PDL=pdl, **wg.layouts(warps, row_tiles, block_k, rows_x))
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "sm_ptr": "*i32", "nw_ptr": "*bf16", "part_ptr": "*fp32",
                "squares_ptr": "*fp32", "arrivals_ptr": "*i32", "out_ptr": "*bf16", "res_ptr": "*bf16", "b_ptr": "*bf16"}
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
    compiled = triton.compile(GluonASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    usage, sass = resources_and_sass(compiled)
    k_step = max(_loops(sass), key=lambda loop: loop["instructions"])
    tile_bytes = block_n * block_k // 2
    print(name, tile, "regs", usage["registers"], "local", usage["local_bytes"], "smem", compiled.metadata.shared,
          "kstep", k_step["instructions"], "per byte", round(k_step["instructions"] * warps / tile_bytes, 3), k_step["top"])
    return compiled

if __name__ == "__main__":
    tiles = [tuple(int(v) for v in t.split(",")) for t in sys.argv[2:]] or [(4, 1, 128, 64)]
    for name in sys.argv[1].split(","):
        for t in tiles:
            try:
                compile_wg(name, t)
            except Exception as e:
                print(name, t, "ERR", str(e)[-1500:])
