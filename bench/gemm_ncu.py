"""One seed-407m prefill product per call for Nsight Compute, through the Gluon INT4 GEMM
(kernels/gluon_gemm_int4.py): `ncu --kernel-name regex:_gemm_int4_kernel --launch-skip 3 --launch-count 1
python bench/gemm_ncu.py [--rows 128] [--n 6144] [--k 2048] [--tile 128 64 4 4 0]` profiles the qkv shape at
128 rows with the launcher's tile (or --tile's), weights streamed from DRAM (a different random copy per
call)."""

from __future__ import annotations

import argparse

import torch

from tinyloop.kernels import cuda_ops
from tinyloop.quant import BlockedInt4Weight


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--n", type=int, default=6144)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--tile", type=int, nargs=5, metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES", "SPLIT_K"),
                    help="the kernel's tile (cuda_ops.GLUON_GEMM_CONFIGS); default: the launcher's")  # fmt: skip
    args = ap.parse_args()
    cuda_ops.USE_GLUON_GEMM = True
    if args.tile:
        cuda_ops.GLUON_GEMM_CONFIGS[(args.n, args.k, 1 << (args.rows - 1).bit_length())] = tuple(args.tile)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = [
        BlockedInt4Weight(
            torch.randint(0, 256, (args.n, args.k // 2), dtype=torch.uint8, device="cuda", generator=gen),
            (torch.rand(args.n, args.k // 64, device="cuda", generator=gen) * 0.01).half(),
            (torch.rand(args.n, args.k // 64, device="cuda", generator=gen) * -0.05).half(),
            64,
        )
        for _ in range(8)
    ]
    x = torch.randn(args.rows, args.k, device="cuda", generator=gen).bfloat16()
    for w in copies:
        cuda_ops._product(x, w, None, None, None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
