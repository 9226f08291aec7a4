"""The CPU decode step of the built-in `tiny` with its float32 matmuls through oneDNN (the default where torch has
it) against `torch.mm`, in one process, interleaved: process-time ms per step at batch 1 and 8. Also oneDNN
without RoPE, the cache write and attention (`onednn_no_attention`: only the QKV product of each attention runs;
wrong logits, for the share of attention in a step). And the products alone: one body iteration's matrices
(4 layers: qkv, out, gate_up, down) at 1, 8 and 16 rows, in microseconds, through `torch.mm` and oneDNN in float32,
and through torch's CPU INT4 kernel and oneDNN on a dense bfloat16 copy (what a bfloat16 model could use).

    python bench/cpu_decode_matmuls.py [--rounds 12] [--steps 40] [--threads 1]

Rows sit at positions 33-60 (one row: 64), as in a continuous-batching scheduler; loops 8; the same cache is
rewritten at those positions every step. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import tinyloop
from tinyloop.runtime.cpu_decode import CpuDecoder

POSITIONS = [40, 50, 33, 60, 45, 41, 38, 59]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = tinyloop.Model("tiny", max_seq_len=256)
    engine = model._engine
    decoders = {
        "onednn": CpuDecoder(engine.cfg, engine.weights, engine.cos, engine.sin, engine.noise, onednn=True),
        "torch_mm": CpuDecoder(engine.cfg, engine.weights, engine.cos, engine.sin, engine.noise, onednn=False),
    }

    def step_ms(decoder: CpuDecoder, batch: int, steps: int) -> float:
        engine.decoder = decoder
        cache = engine.new_cache(batch, 256, 8)
        tokens = torch.randint(0, 256, (batch, 1), generator=torch.Generator().manual_seed(0))
        lengths = torch.tensor(POSITIONS[:batch] if batch > 1 else [64])
        t0 = time.process_time()
        for _ in range(steps):
            cache.lengths = lengths.clone()
            engine.step(tokens, cache, 8, last_only=True)
        return (time.process_time() - t0) / steps * 1e3

    full_attention = CpuDecoder._attention

    def qkv_only(self: CpuDecoder, h: torch.Tensor, lp, cache, slot: int, st, buf) -> None:  # noqa: ANN001
        buf.product_into(buf.qkv, h, lp.qkv, lp.qkv_bias)

    def step_variant(name: str, batch: int, steps: int) -> float:
        CpuDecoder._attention = qkv_only if name == "onednn_no_attention" else full_attention  # type: ignore[method-assign]
        try:
            return step_ms(decoders["onednn" if name == "onednn_no_attention" else name], batch, steps)
        finally:
            CpuDecoder._attention = full_attention  # type: ignore[method-assign]

    variants = (*decoders, "onednn_no_attention")
    result: dict[str, object] = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, {a.threads} threads",
        "load_average_at_start": os.getloadavg(),
    }
    for batch in (1, 8):
        times: dict[str, list[float]] = {name: [] for name in variants}
        for name in variants:
            step_variant(name, batch, 3)
        for _ in range(a.rounds):
            for name in variants:
                times[name].append(step_variant(name, batch, a.steps))
        result[f"batch_{batch}_ms_per_step"] = {name: statistics.median(t) for name, t in times.items()}
    result["body_iteration_products_us"] = body_products(a.rounds)
    result["load_average_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))


def pack_bfloat16(w: torch.Tensor) -> object:
    from tinyloop.kernels import cpu_onednn

    packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16().contiguous(), cpu_onednn.PACKED_FOR_ROWS)
    return cpu_onednn.OneDnnMatrix(packed, w.shape)


def body_products(rounds: int) -> dict[str, dict[int, float]]:
    from tinyloop.kernels import cpu_int4, cpu_onednn

    body = tinyloop.Model("tiny", max_seq_len=64, dtype=torch.bfloat16)._engine.weights.body
    int4 = [(lw.qkv, lw.out, lw.gate_up, lw.down) for lw in body]
    dense = [tuple(m.dense.float() for m in mats) for mats in int4]  # type: ignore[union-attr]
    kernels = {
        "float32_torch_mm": [tuple(m.t().contiguous() for m in mats) for mats in dense],
        "float32_onednn": [tuple(cpu_onednn.pack(m) for m in mats) for mats in dense],
        "int4_kernel_bf16": int4,
        "bfloat16_onednn": [tuple(pack_bfloat16(m) for m in mats) for mats in dense],
    }

    def product(x: torch.Tensor, m: object) -> torch.Tensor:
        if isinstance(m, cpu_onednn.OneDnnMatrix):
            return cpu_onednn.matmul(x.to(m.packed.dtype), m)
        if isinstance(m, torch.Tensor):
            return torch.mm(x, m)
        return cpu_int4.matmul(x.bfloat16(), m)  # type: ignore[arg-type]

    out: dict[str, dict[int, float]] = {name: {} for name in kernels}
    for rows in (1, 8, 16):
        x, xf = torch.randn(rows, 384), torch.randn(rows, 1024)
        for name, layers in kernels.items():
            runs = []
            for _ in range(rounds):
                t0 = time.process_time()
                for _ in range(20):
                    for qkv, o, gu, down in layers:
                        product(x, qkv), product(x, o), product(x, gu), product(xf, down)
                runs.append((time.process_time() - t0) / 20 * 1e6)
            out[name][rows] = statistics.median(runs)
    return out


if __name__ == "__main__":
    main()
