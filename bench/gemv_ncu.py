"""One seed-407m decode GEMV per shape for Nsight Compute: `ncu --kernel-name regex:_gemv --launch-skip 3
--launch-count 1 python bench/gemv_ncu.py` profiles qkv (norm; `--launch-skip 11`: gate / up, norm + SwiGLU) at
the built-in tiles, with weights streamed from DRAM (a different random copy per call). The Gluon GEMV where
it builds; `--triton` for the Triton one, `--staged` for the staged one (kernel regex `_gemv_int4_staged`).
Profiles of the default kernels: bench/results/ncu/."""

from __future__ import annotations

import argparse

import torch

from tinyloop.kernels import cuda_ops
from tinyloop.kernels.cuda_backend import gluon_supported, staged_supported
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.quant import BlockedInt4Weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton", action="store_true", help="the Triton GEMV instead of the Gluon one")
    ap.add_argument("--staged", action="store_true", help="the staged GEMV (weights fetched by TMA before the wait)")
    args = ap.parse_args()
    policy = KernelPolicy(
        gluon_gemv=not args.triton and gluon_supported(), staged_gemv=args.staged and staged_supported()
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n_rows, act in ((6144, cuda_ops.ACT_NONE), (2 * 5632, cuda_ops.ACT_SWIGLU)):
        k = 2048
        copies = [
            BlockedInt4Weight(
                torch.randint(0, 256, (n_rows, k // 2), dtype=torch.uint8, device="cuda", generator=gen),
                (torch.rand(n_rows, k // 64, device="cuda", generator=gen) * 0.01).half(),
                (torch.rand(n_rows, k // 64, device="cuda", generator=gen) * -0.05).half(),
                64,
            )
            for _ in range(8)
        ]
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        gain = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).bfloat16()
        for w in copies:
            cuda_ops.fused_linear(policy, x, w, norm_weight=gain, eps=1e-6, act=act)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
