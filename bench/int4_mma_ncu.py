"""The tensor-core INT4 product of seed-407m's shapes at one row count, for Nsight Compute:

    ncu --kernel-name regex:_int4_mma_kernel --launch-skip 4 --launch-count 1 --section SchedulerStats \\
        --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \\
        python bench/int4_mma_ncu.py --shape qkv --rows 32

runs the policy's kernel (the warpgroup version on Hopper) over 16 random copies of the matrix in turn, so each
launch streams its weights from DRAM; launch 5 is the first after compiling and the warm-ups. Shows whether a
product waits on memory (long-scoreboard stalls) or on issue (eligible warps, issue slots).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from gluon_gemv_rows import COPIES, SHAPES, fused_product, random_int4_copies

from tinyloop.env import RuntimeEnv
from tinyloop.kernels.cuda_backend import kernel_policy
from tinyloop.quant import CudaMmaInt4Weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qkv")
    ap.add_argument("--rows", type=int, default=32)
    args = ap.parse_args()
    policy = dataclasses.replace(kernel_policy(RuntimeEnv.read()), mma_int4=True)
    n, k, act, norm, resid = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    copies = [CudaMmaInt4Weight.from_int4(w, torch.bfloat16) for w in random_int4_copies(n, k, gen)]
    x = torch.randn(args.rows, k, generator=gen).to(dev, torch.bfloat16)
    gain = (1 + 0.1 * torch.randn(k, generator=gen)).to(dev, torch.bfloat16) if norm else None
    res = torch.randn(args.rows, n // 2 if act == 1 else n, generator=gen).to(dev, torch.bfloat16) if resid else None
    product = fused_product(policy, x, copies, gain, act, res)
    for i in range(COPIES):
        product(i)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
