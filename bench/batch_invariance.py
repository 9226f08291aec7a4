"""Batch invariance on the GPU: does a sequence decode the same tokens alone, in any batch, and through the
Scheduler (its prompt chunked differently, other requests joining), with the default kernels and with
TINYLOOP_BATCH_INVARIANT=1? And what the mode costs.

    PYTHONPATH=src:bench python bench/batch_invariance.py --model seed.tinyloop --out F.json [--loops 8] [--tokens 48] \
        [--prompts 6] [--modes default batch_invariant] [--no-timing] [--policy batch_invariant_max_splits=4]

For each mode (a Model loaded with the switch unset, then one loaded with it set):
- alone: each of `--prompts` random prompts (17-200 tokens) through `generate`, greedy;
- batches: `generate_batch` of B = 2, 3, 8, 16, 33 and 64 rows, the prompts first and other random prompts after;
  each prompt's row against its tokens alone (rows equal, and the first token where a row parts);
- scheduler: the prompts through a `Scheduler` of 8 slots with 48-token prefill chunks, submitted 2 steps
  apart behind 4 other requests, against alone;
- timing: B = 1 decode of 128 tokens after a 128-token prompt (`generate`(129) - `generate`(1), median of 3),
  `generate_batch` aggregate tokens/s at B = 8, 32 and 64 (65 new tokens, prefill included) and a 512-token
  prefill (`generate`(1), median of 3).
Random-weight models have many near-ties in their logits, so any change of rounding soon shows as a token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gpu_batched_decode import parse_overrides
from gpu_suite import policy_overrides

import tinyloop

BATCHES = (2, 3, 8, 16, 33, 64)
SWITCH = "TINYLOOP_BATCH_INVARIANT"


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first index where two token sequences differ (their shorter length where one is a prefix), or None."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def compare(rows: list[np.ndarray], alone: list[np.ndarray]) -> dict:
    parts = [first_difference(r, a) for r, a in zip(rows, alone, strict=True)]
    return {"rows_equal": sum(p is None for p in parts), "rows": len(parts), "parts_at": parts}


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def check_mode(model: tinyloop.Model, prompts: list[np.ndarray], fillers: list[np.ndarray], args) -> dict:  # type: ignore[no-untyped-def]
    greedy = dict(loops=args.loops, temperature=0.0)
    model.generate(prompts[0], 4, **greedy)  # warm-up: kernels compiled, graphs captured
    alone = [np.asarray(model.generate(p, args.tokens, **greedy)) for p in prompts]
    result: dict = {"batches": {}}
    for b in BATCHES:
        batch = (prompts + fillers)[:b]
        rows = model.generate_batch(batch, args.tokens, **greedy)
        kept = min(b, len(prompts))
        result["batches"][b] = compare(rows[:kept], alone[:kept])
        print(b, result["batches"][b], flush=True)
    with tinyloop.Scheduler(model, max_batch=8, prefill_chunk_tokens=48) as sched:
        early = [sched.submit(f, max_tokens=args.tokens, **greedy) for f in fillers[:4]]
        handles = []
        for p in prompts:
            handles.append(sched.submit(p, max_tokens=args.tokens, **greedy))
            time.sleep(0.01)
        rows = [np.asarray(h.result()) for h in handles]
        for h in early:
            h.result()
    result["scheduler"] = compare(rows, alone)
    print("scheduler", result["scheduler"], flush=True)
    if args.no_timing:
        return result
    rng = np.random.default_rng(1)
    vocab = model.header.config.vocab_size
    prompt128 = rng.integers(0, vocab, 128).astype(np.int32)
    prompt512 = rng.integers(0, vocab, 512).astype(np.int32)
    one = [timed(lambda: model.generate(prompt128, 1, **greedy)) for _ in range(3)]
    full = [timed(lambda: model.generate(prompt128, 129, **greedy)) for _ in range(3)]
    result["b1_decode_128_ms"] = round(1000 * (statistics.median(full) - statistics.median(one)), 1)
    result["prefill_512_ms"] = round(1000 * statistics.median(
        timed(lambda: model.generate(prompt512, 1, **greedy)) for _ in range(3)), 1)  # fmt: skip
    result["batch_tokens_per_s"] = {}
    for b in (8, 32, 64):
        batch = [rng.integers(0, vocab, 128).astype(np.int32) for _ in range(b)]
        model.generate_batch(batch, 4, **greedy)
        seconds = timed(lambda batch=batch: model.generate_batch(batch, 65, **greedy))
        result["batch_tokens_per_s"][b] = round(b * 65 / seconds)
    print("timing", {k: v for k, v in result.items() if k not in ("batches", "scheduler")}, flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--modes", nargs="+", default=["default", "batch_invariant"])
    ap.add_argument("--no-timing", action="store_true", help="the checks alone")
    ap.add_argument("--policy", nargs="*", default=[], help="KernelPolicy fields to replace, as FIELD=VALUE")
    args = ap.parse_args()
    with policy_overrides(parse_overrides(args.policy, None)):
        run(args)


def run(args: argparse.Namespace) -> None:
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
                    "loops": args.loops, "tokens": args.tokens, "policy": args.policy}  # fmt: skip
    for mode in args.modes:
        os.environ[SWITCH] = "1" if mode == "batch_invariant" else "0"
        model = tinyloop.Model(args.model, max_seq_len=1024, device="cuda")
        rng = np.random.default_rng(0)  # the same prompts in every mode
        vocab = model.header.config.vocab_size
        prompts = [rng.integers(0, vocab, int(n)).astype(np.int32) for n in rng.integers(17, 201, args.prompts)]
        fillers = [rng.integers(0, vocab, int(n)).astype(np.int32) for n in rng.integers(17, 201, 64)]
        result[mode] = check_mode(model, prompts, fillers, args)
        model.close()
        del model
        torch.cuda.empty_cache()
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
