"""GPU check through the public API only, so the same script times this tree and an older checkout.

Sections (all on one CUDA device):
- correctness: logits of `score` on the GPU against the CPU (relative Frobenius), greedy tokens GPU against
  CPU, and `generate_batch` rows against the same prompt alone, for the built-in `tiny` and a seed model;
- batched against alone per dtype: the seed model's `generate_batch` at B = 2 and 4 against each prompt alone,
  in float32 and bfloat16 (leading tokens that agree);
- the Scheduler: greedy requests joining at different steps against each alone, float32;
- timing: B=1 decode of 128 tokens after a 128-token prompt, as `generate`(129 tokens) − `generate`(1 token),
  median of 7; `generate_batch` aggregate tokens/s at B = 1-64 (65 new tokens, the prefill included).

Sections that need `generate_batch` are left out where the checked-out tree has none (an older base commit).

    PYTHONPATH=<tree>/src python bench/gpu_public_api_check.py --label L --seed-model seed.tinyloop --out F.json

`--timing-only` runs the timing section alone. The seed model: `tinyloop-convert --random --preset seed-407m
--bits 4 -o seed.tinyloop`. Results of 2026-12-06: bench/results/h100_engine_batching_serving.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import tinyloop

LOOPS = 8
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CODE_STARTS = ("def fibonacci(n):", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self")


def relative_frobenius(actual: object, expected: object) -> float:
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def correctness(path: str, ids: np.ndarray, prompts: list[np.ndarray], new_tokens: int) -> dict:
    cpu = tinyloop.Model(path, max_seq_len=512, device="cpu")
    gpu = tinyloop.Model(path, max_seq_len=512, device="cuda")
    result: dict = {
        "score_rel_frob": relative_frobenius(gpu.score(ids, loops=LOOPS), cpu.score(ids, loops=LOOPS)),
        "short_score_rel_frob": relative_frobenius(gpu.score(ids[:12], loops=LOOPS), cpu.score(ids[:12], loops=LOOPS)),
    }
    alone = [gpu.generate(p, new_tokens, loops=LOOPS, temperature=0.0) for p in prompts]
    on_cpu = [cpu.generate(p, new_tokens, loops=LOOPS, temperature=0.0) for p in prompts]
    result["greedy_agree"] = [f"{agreeing_prefix(c, g)}/{new_tokens}" for c, g in zip(on_cpu, alone, strict=True)]
    if hasattr(gpu, "generate_batch"):
        batch = gpu.generate_batch(prompts, max_tokens=new_tokens, loops=LOOPS, temperature=0.0)
        pairs = zip(alone, batch, strict=True)
        result["gpu_batch_vs_alone"] = [f"{agreeing_prefix(a, b)}/{len(a)}" for a, b in pairs]
    gpu.close()
    cpu.close()
    torch.cuda.empty_cache()
    return result


def batched_vs_alone_per_dtype(path: str, prompts: list[np.ndarray], new_tokens: int = 32) -> dict:
    """Agreeing leading tokens of each `generate_batch` row against the prompt alone, per dtype and batch."""
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tinyloop.Model(path, max_seq_len=512, device="cuda", dtype=dtype)
        alone = [model.generate(p, new_tokens, loops=LOOPS, temperature=0.0) for p in prompts]
        for batch_size in (2, 4):
            batch = model.generate_batch(prompts[:batch_size], max_tokens=new_tokens, loops=LOOPS, temperature=0.0)
            key = f"{str(dtype).removeprefix('torch.')}_B{batch_size}"
            pairs = zip(alone[:batch_size], batch, strict=True)
            result[key] = [f"{agreeing_prefix(a, b)}/{len(a)}" for a, b in pairs]
        model.close()
        torch.cuda.empty_cache()
    return result


def scheduler_vs_alone(path: str, prompts: list[np.ndarray], new_tokens: int = 24) -> list[str]:
    """Agreeing leading tokens of each request run through a `Scheduler` (submitted two at a time between
    steps; prompt chunks of 24 tokens, several prompts per prefill step) against the prompt alone, float32."""
    model = tinyloop.Model(path, max_seq_len=512, device="cuda", dtype=torch.float32)
    alone = [model.generate(p, new_tokens, loops=LOOPS, temperature=0.0) for p in prompts]
    scheduler = tinyloop.Scheduler(model, max_batch=4, max_loops=LOOPS, prefill_chunk_tokens=24, prefill_rows=3)
    handles = []
    for i, p in enumerate(prompts):
        handles.append(scheduler.submit(p, new_tokens, loops=LOOPS, temperature=0.0))
        if i % 2:
            scheduler.step()
    scheduler.stop(drain=True)
    agree = [f"{agreeing_prefix(a, h.result())}/{len(a)}" for a, h in zip(alone, handles, strict=True)]
    model.close()
    torch.cuda.empty_cache()
    return agree


def timing(path: str, prompt_len: int = 128, new_tokens: int = 128, repeat: int = 7) -> dict:
    model = tinyloop.Model(path, max_seq_len=1024, device="cuda")
    rng = np.random.default_rng(1)
    vocab = model.config["vocab_size"]
    prompt = rng.integers(0, vocab, prompt_len).astype(np.int32)

    def timed_generate(count: int) -> tuple[float, int]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, count, loops=LOOPS, temperature=0.0)
        torch.cuda.synchronize()
        return time.perf_counter() - start, len(out)

    for _ in range(2):
        timed_generate(new_tokens + 1)
        timed_generate(1)
    decode_ms = []
    for _ in range(repeat):
        first_s, _ = timed_generate(1)
        all_s, produced = timed_generate(new_tokens + 1)
        decode_ms.append((all_s - first_s) * 1e3 * new_tokens / max(produced - 1, 1))
    result: dict = {"decode_128_ms_median": statistics.median(decode_ms), "decode_128_ms_min": min(decode_ms)}
    if hasattr(model, "generate_batch"):
        for batch_size in BATCH_SIZES:
            prompts = [rng.integers(0, vocab, prompt_len).astype(np.int32) for _ in range(batch_size)]
            try:
                model.generate_batch(prompts, max_tokens=8, loops=LOOPS, temperature=0.0)
                torch.cuda.synchronize()
                start = time.perf_counter()
                outs = model.generate_batch(prompts, max_tokens=65, loops=LOOPS, temperature=0.0)
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                result[f"batch{batch_size}_tok_s_incl_prefill"] = sum(len(o) for o in outs) / elapsed
            except (RuntimeError, ValueError) as error:  # out of memory or a limit: report it, time the rest
                result[f"batch{batch_size}_error"] = repr(error)[:200]
    model.close()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="name of the checked-out tree, stored in the result")
    parser.add_argument("--seed-model", required=True, help="a seed-407m .tinyloop file")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--timing-only", action="store_true")
    parser.add_argument("--no-timing", action="store_true", help="the correctness sections alone")
    args = parser.parse_args()
    result: dict = {"label": args.label, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    if not args.timing_only:
        text = Path(tinyloop.__file__).read_bytes()[:400]
        ids = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
        prompts = [np.frombuffer(p.encode(), dtype=np.uint8).astype(np.int32) for p in CODE_STARTS]
        result["tiny"] = correctness("tiny", ids, prompts, 48)
        seed_ids = np.random.default_rng(0).integers(0, 32000, 160).astype(np.int32)
        result["seed407m"] = correctness(args.seed_model, seed_ids, [seed_ids[:16], seed_ids[40:60]], 32)
        if hasattr(tinyloop.Model, "generate_batch"):
            seed_prompts = [seed_ids[:16], seed_ids[40:60], seed_ids[80:85], seed_ids[100:140]]
            result["seed407m_batch_vs_alone_by_dtype"] = batched_vs_alone_per_dtype(args.seed_model, seed_prompts)
        if hasattr(tinyloop, "Scheduler"):
            seed_prompts.append(seed_ids[20:50])
            result["seed407m_scheduler_vs_alone"] = scheduler_vs_alone(args.seed_model, seed_prompts)
            result["tiny_scheduler_vs_alone"] = scheduler_vs_alone("tiny", prompts + [ids[:70], ids[200:230]])
    if not args.no_timing:
        result["seed407m_timing"] = timing(args.seed_model)
        result["tiny_timing"] = timing("tiny")
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
