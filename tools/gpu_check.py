"""GPU correctness: CUDA logits against the CPU float32 result, prefill and cached decode.

Usage (on a CUDA machine): PYTHONPATH=src python3 tools/gpu_check.py [--model FILE ...] [--out FILE.json]
Relative Frobenius error per dtype; greedy agreement on the first 32 tokens for each model file given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import random_flat_weights  # noqa: E402
from tinyloop.config import ArchConfig  # noqa: E402
from tinyloop.model.weights import ModelWeights  # noqa: E402
from tinyloop.presets import preset  # noqa: E402
from tinyloop.runtime.engine import Engine  # noqa: E402
from tinyloop.runtime.loader import prepare_weights  # noqa: E402

MEDIUM = ArchConfig(
    vocab_size=4096, d_model=512, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=1408,
    n_prelude=1, n_body=3, n_coda=1, injection="add", max_position=2048, name="medium",
)  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def run_engine(cfg: ArchConfig, flat: dict, device: str, dtype: torch.dtype, tokens: torch.Tensor, loops: int):
    engine = Engine(cfg, ModelWeights.from_flat(cfg, prepare_weights(flat, torch.device(device), dtype)),
                    torch.device(device), dtype)  # fmt: skip
    prefill = engine.step(tokens[None, :-8], None, loops).logits[0]
    cache = engine.new_cache(1, 256, loops)
    engine.step(tokens[None, :-8], cache, loops)
    decoded = [
        engine.step(tokens[None, i : i + 1], cache, loops, last_only=True).logits[0, 0]
        for i in range(len(tokens) - 8, len(tokens))
    ]
    return prefill, torch.stack(decoded)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results: dict[str, object] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for cfg in (preset("test-tiny"), MEDIUM):
        flat = random_flat_weights(cfg, seed=3)
        tokens = torch.randint(0, cfg.vocab_size, (120,), generator=torch.Generator().manual_seed(1))
        ref_p, ref_d = run_engine(cfg, flat, "cpu", torch.float32, tokens, 4)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            p, d = run_engine(cfg, flat, "cuda", dtype, tokens, 4)
            key = f"{cfg.name}/{str(dtype).removeprefix('torch.')}"
            results[key] = {"prefill_rel_frobenius": rel(p, ref_p), "decode_rel_frobenius": rel(d, ref_d)}
            print(key, results[key], flush=True)
    for path in args.model:
        import tinyloop

        prompt = list(b"def fibonacci(n):\n")
        outs = {}
        for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16), ("cuda", torch.float16)):
            with tinyloop.Model(path, max_seq_len=256, device=device, dtype=dtype) as m:
                outs[f"{device}/{dtype}"] = m.generate(prompt, 32, loops=8, temperature=0.0).tolist()
        ref = outs["cpu/torch.float32"]
        for key, toks in outs.items():
            agree = next((i for i, (a, b) in enumerate(zip(ref, toks, strict=False)) if a != b), 32)
            results[f"greedy/{Path(path).name}/{key}"] = {"agreeing_prefix": agree, "tokens": toks}
            print(path, key, "greedy agreement with CPU float32:", agree, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
