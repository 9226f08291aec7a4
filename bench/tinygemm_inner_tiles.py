"""torch's CUDA tinygemm INT4 kernel (`aten._weight_int4pack_mm`) bare, at each packed layout (2, 4 and 8 K tiles
per warp: `quant.CudaTinygemmWeight.INNER_K_TILES` is the choice), against cuBLAS on a bfloat16 copy, for
seed-407m's four layer products at 1-64 rows. Weights stream from DRAM (copies of at least 256 MB cycled inside
one CUDA graph); each product's error against float64 of the dequantized weight. Device only.

    PYTHONPATH=src python bench/tinygemm_inner_tiles.py --out F.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from cuda_timing import graph_us

from tinyloop.quant import CudaTinygemmWeight, quantize_int4

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
ROWS = (1, 2, 3, 4, 8, 16, 32, 64)
INNER_K_TILES = (2, 4, 8)
STREAM_BYTES = 256e6


def cycled(fns: list) -> object:
    calls = itertools.cycle(fns)
    return lambda: next(calls)()


def streamed_us(fn, weights: list) -> float:  # type: ignore[no-untyped-def]
    """µs per call of fn(weight), the weights cycled twice inside one CUDA graph (so they stream from DRAM)."""
    return round(graph_us(cycled([lambda w=w: fn(w) for w in weights]), 2 * len(weights)), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = quantize_int4(torch.randn(n, k, generator=gen) / k**0.5, 64).to("cuda")
        dense = w.dequantize(torch.float64)
        copies = max(2, int(STREAM_BYTES // (n * k // 2)))
        packs = {inner: [CudaTinygemmWeight.from_int4(w, inner) for _ in range(copies)] for inner in INNER_K_TILES}
        bf16 = [dense.to(torch.bfloat16) for _ in range(max(2, int(STREAM_BYTES // (n * k * 2))))]
        entry: dict = {}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            ref = x.double() @ dense.t()
            row: dict = {}
            for inner, weights in packs.items():
                row[f"inner{inner}_rel_err"] = float((weights[0].mm(x).double() - ref).norm() / ref.norm())
                row[f"inner{inner}_us"] = streamed_us(lambda p, x=x: p.mm(x), weights)
            row["cublas_rel_err"] = float((F.linear(x, bf16[0]).double() - ref).norm() / ref.norm())
            row["cublas_us"] = streamed_us(lambda c, x=x: F.linear(x, c), bf16)
            entry[m] = row
            print(name, m, {key: v for key, v in row.items() if key.endswith("_us")}, flush=True)
        result["shapes"][name] = entry
        del packs, bf16
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
