"""FBGEMM's mixed-input INT4 GEMM (`torch.ops.fbgemm.bf16i4bf16_rowwise`, PyPI `fbgemm-gpu-genai`: CUTLASS,
bfloat16 activations times INT4 weights with group scales and zeros, Hopper) against the products batched decode
steps run today: TinyLoop's tensor-core INT4 kernel (kernels/gluon_int4_mma.py, through the launcher) and cuBLAS
on a 16-bit copy. seed-407m's four layer products as plain products (no norm, activation or residual, so that
all three do the same work), 2-64 rows of x, weights streamed from DRAM (16 copies per shape cycled inside one
CUDA graph), relative error against float32 of the dequantized INT4 weight. Device only; FBGEMM is not a
dependency of the package.

FBGEMM's weight format is ours: its codes are q - 8 (signed nibbles, two a byte, even column in the low nibble),
its group zero is minimum + 8 x scale (as tinygemm's), scales and zeros [K / group, N]. So the codes, scales and
minimums of the same matrix are passed through, nothing requantized.

The wheel matching the device's torch (2.11: FBGEMM 1.6.0, built for CUDA 13) carries as a file; its operator
library loads by path (`--library`), without the rest of the fbgemm_gpu package (without `--library` the script
imports the installed package):

    pip download --no-deps --only-binary=:all: --python-version 3.12 fbgemm-gpu-genai==1.6.0 -d build/  # here, once
    python3 -m zipfile -e build/fbgemm_gpu_genai-1.6.0-*.whl /tmp/fbgemm && PYTHONPATH=src:bench python3 \\
        bench/fbgemm_int4.py --library /tmp/fbgemm/fbgemm_gpu/experimental/gen_ai/fbgemm_gpu_experimental_gen_ai.so \\
        --out F.json
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch
from gluon_gemv_rows import SHAPES, copies_us, fused_product, random_int4_copies, write_json

from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_ops
from tinyloop.kernels.cuda_backend import kernel_policy
from tinyloop.quant import BlockedInt4Weight, CudaMmaInt4Weight

PRODUCTS = {name: (n, k) for name, (n, k, *_) in SHAPES.items()}  # as plain products


def fbgemm_operands(w: BlockedInt4Weight, scale_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """w as bf16i4bf16_rowwise takes it: packed signed codes [N, K / 2] int8, scales and zeros [K / G, N]."""
    centred = w.codes(w.packed).to(torch.int16) - 8
    packed = ((centred[:, ::2] & 0xF) | ((centred[:, 1::2] & 0xF) << 4)).to(torch.uint8).view(torch.int8)
    scale = w.scale.float()
    zero = w.minimum.float() + 8 * scale
    return packed.contiguous(), scale.t().contiguous().to(scale_dtype), zero.t().contiguous().to(scale_dtype)


def measure(label: str, fn: Callable[[int], torch.Tensor], ref: torch.Tensor, row: dict) -> None:
    try:
        got = fn(0)
        torch.cuda.synchronize()
        err = float((got.float() - ref).norm() / ref.norm())
        row[label] = {"us": round(copies_us(fn), 2), "rel_err": err}
    except Exception as exc:  # noqa: BLE001 - recorded; the other kernels are still measured
        row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(f"  {label}: {row[label]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--library", help="fbgemm_gpu_experimental_gen_ai.so from the wheel (default: import the package)")
    ap.add_argument("--rows", type=int, nargs="*", default=[2, 8, 16, 32, 64])
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--products", nargs="*", default=list(PRODUCTS))
    args = ap.parse_args()
    if args.library:
        torch.ops.load_library(args.library)
    else:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401  # registers torch.ops.fbgemm
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    policy = dataclasses.replace(kernel_policy(RuntimeEnv.read()), mma_int4=True)
    gen = torch.Generator().manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "library": args.library,
                    "group": args.group, "products": {}}  # fmt: skip
    for name in args.products:
        n, k = PRODUCTS[name]
        ws = random_int4_copies(n, k, gen, args.group)
        dense = [cuda_ops.dequantize_int4(w, torch.bfloat16) for w in ws]
        exact = ws[0].dequantize(torch.float32)
        mma = [CudaMmaInt4Weight.from_int4(w, torch.bfloat16) for w in ws]
        fb = {dt: [fbgemm_operands(w, dt) for w in ws] for dt in (torch.bfloat16, torch.float32)}
        entry: dict = {"weight_MB": round(ws[0].nbytes / 1e6, 2)}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            ref = x.float() @ exact.t()
            row: dict = {}
            print(f"{name} {m} rows", flush=True)
            measure("tinyloop_int4", fused_product(policy, x, mma, None, 0, None), ref, row)
            measure("cublas_16bit", lambda i, x=x, dense=dense: x @ dense[i].t(), ref, row)
            for dt, ops in fb.items():
                label = f"fbgemm_{str(dt)[6:]}_scales"
                measure(label, lambda i, x=x, ops=ops: torch.ops.fbgemm.bf16i4bf16_rowwise(x, *ops[i]), ref, row)
            entry[m] = row
        result["products"][name] = entry
        write_json(args.out, result)
        del ws, dense, mma, fb
        torch.cuda.empty_cache()
    for m in args.rows:
        layer = {}
        for label in ("tinyloop_int4", "cublas_16bit", "fbgemm_bfloat16_scales", "fbgemm_float32_scales"):
            cells = [result["products"][p][m].get(label, {}) for p in args.products]
            if all("us" in c for c in cells):
                layer[label] = round(sum(c["us"] for c in cells), 1)
        result[f"layer_{m}_us"] = layer
        print(f"layer at {m} rows (us): {layer}", flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
