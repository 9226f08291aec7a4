"""Is a row's product the same bits at every row count? The warpgroup INT4 kernel (kernels/gluon_int4_mma.py) on
seed-407m's four layer products (bfloat16, random INT4 weights, the shapes' norm / SwiGLU / residual epilogues),
counting the output elements of the first rows that differ:

- `default_R_vs_32`: the default policy, R rows against the same rows inside a 32-row product;
- `gemv1_vs_32_row0`: the one-row GEMV against row 0 of the 32-row product (another kernel: expected to differ);
- `TILE_R_vs_2`: one tile forced at every row count (K split by the policy's programs over that tile's output
  tiles), R rows against 2;
- `mp16_vs_mp32_same_splits` / `mp16_vs_mp64_same_splits`: 16 rows in x tiles of 16, 32 and 64 rows, K split alike;
- `batch_invariant_R_vs_1`: the batch-invariant policy (TINYLOOP_BATCH_INVARIANT=1's), R rows against 1.

    PYTHONPATH=src python bench/int4_mma_invariance.py F.json

Device only (Hopper).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
from gluon_gemv_rows import SHAPES

from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_ops
from tinyloop.kernels.cuda_backend import kernel_policy
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.quant import BlockedInt4Weight, CudaMmaInt4Weight, quantize_int4

TILES = ((8, 1, 128, 32), (4, 2, 128, 32), (8, 1, 128, 16))


def forced(
    policy: KernelPolicy, n: int, k: int, tile: tuple[int, int, int, int], programs: int | None = None
) -> KernelPolicy:
    """The policy with `tile` at every row count of an n x k matrix, K split until about `programs` (default: the
    policy's) programs run, without the split cap."""
    return dataclasses.replace(policy, mma_int4_tiles={(n, k, m): tile for m in range(1, 65)},
                               mma_int4_wgmma_split_rows=1 << 20,
                               mma_int4_wgmma_programs=programs or policy.mma_int4_wgmma_programs)  # fmt: skip


def main() -> None:
    policy = dataclasses.replace(kernel_policy(RuntimeEnv.read()), mma_int4=True)
    invariant = dataclasses.replace(policy, batch_invariant=True)
    gen = torch.Generator().manual_seed(0)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, (n, k, act, norm, resid) in SHAPES.items():
        w = BlockedInt4Weight.from_int4(quantize_int4(torch.randn(n, k, generator=gen) / k**0.5, 64)).to("cuda")
        copy = CudaMmaInt4Weight.from_int4(w, torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(k, generator=gen)).to("cuda", torch.bfloat16) if norm else None
        n_out = n // 2 if act == 1 else n
        x = torch.randn(64, k, generator=gen).to("cuda", torch.bfloat16)
        r = torch.randn(64, n_out, generator=gen).to("cuda", torch.bfloat16) if resid else None

        def run(pol, m, weight=copy, x=x, r=r, nw=nw, act=act):  # type: ignore[no-untyped-def]
            res = None if r is None else r[:m].clone()
            return cuda_ops.fused_linear(pol, x[:m], weight, norm_weight=nw, eps=1e-6, act=act, residual=res).clone()

        def differing(a: torch.Tensor, b: torch.Tensor) -> int:
            return int((a != b).sum())

        d: dict = {}
        full = run(policy, 32)
        for m in (2, 3, 4, 8, 16, 17):
            d[f"default_{m}_vs_32"] = differing(run(policy, m), full[:m])
        d["gemv1_vs_32_row0"] = differing(run(policy, 1, w), full[:1])
        for tile in TILES:
            pol = forced(policy, n, k, tile)
            two = run(pol, 2)
            for m in (3, 4, 8, 16, 32, 64):
                d[f"{tile}_{m}_vs_2"] = differing(run(pol, m)[:2], two)
        programs = n // 128 * 4  # four splits of every x tile's 16 rows
        sixteen = run(forced(policy, n, k, (8, 1, 128, 16), programs), 16)
        d["mp16_vs_mp32_same_splits"] = differing(sixteen, run(forced(policy, n, k, (8, 1, 128, 32), programs), 16))
        d["mp16_vs_mp64_same_splits"] = differing(sixteen, run(forced(policy, n, k, (8, 1, 128, 64), programs), 16))
        one = run(invariant, 1)
        for m in (2, 3, 16, 17, 33, 64):
            d[f"batch_invariant_{m}_vs_1"] = differing(run(invariant, m)[:1], one)
        out[name] = d
        print(name, d, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
