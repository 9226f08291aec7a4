"""GPU timings of the current engine: decode, prefill, decode vs loops, speculative vs plain.

One device call (repo root, CUDA machine):
    PYTHONPATH=src python3 bench/gpu_generation.py --out $OUT/gpu_generation.json
Writes a JSON with every number (medians of repeated runs) for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import tinyloop


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    times = timed(lambda: y.copy_(x), 10)
    return 2 * x.numel() / statistics.median(times)  # bytes read + written per second


def bench_model(path: str, loops: int, rng: np.random.Generator, spec_pairs, prompt_len=128, new=128, repeat=3):
    res: dict[str, object] = {}
    with tinyloop.Model(path, max_seq_len=2048, device="cuda") as m:
        vocab = m.config["vocab_size"]
        prompt = rng.integers(0, vocab, prompt_len).astype(np.int32)
        m.generate(prompt, 8, loops=loops, temperature=0.0)  # warm-up
        t = timed(lambda: m.generate(prompt, new, loops=loops, temperature=0.0), repeat)
        res["decode_128_after_128_ms"] = 1e3 * statistics.median(t)
        res["decode_tokens_per_s"] = m.last_stats.decode_tokens_per_s
        for n in (128, 1024):
            ids = rng.integers(0, vocab, n).astype(np.int32)
            m.score_last(ids, loops=loops)
            res[f"prefill_{n}_ms"] = 1e3 * statistics.median(timed(lambda ids=ids: m.score_last(ids, loops=loops), 5))
        per_loops = {}
        for L in (1, 2, 4, 8, 16):
            m.generate(prompt, 4, loops=L, temperature=0.0)
            tt = timed(lambda L=L: m.generate(prompt, 64, loops=L, temperature=0.0), 2)
            per_loops[L] = 63 / (statistics.median(tt) - 0.0)
        res["decode_tokens_per_s_by_loops_incl_prefill"] = per_loops
        spec = {}
        for d, v in spec_pairs:
            plain = m.generate(prompt, new, loops=v, temperature=0.0)
            tp = statistics.median(timed(lambda v=v: m.generate(prompt, new, loops=v, temperature=0.0), 2))
            out = m.generate_speculative(prompt, new, draft_loops=d, verify_loops=v, draft_ahead=4, temperature=0.0)
            ts = statistics.median(
                timed(lambda d=d, v=v: m.generate_speculative(prompt, new, draft_loops=d, verify_loops=v), 2)
            )
            spec[f"{d},{v}"] = {
                "identical_to_plain": bool(np.array_equal(out.tokens, plain)),
                "acceptance_rate": out.acceptance_rate,
                "tokens_per_verify": out.tokens_per_verify,
                "plain_tokens_per_s": new / tp,
                "speculative_tokens_per_s": new / ts,
            }
        res["speculative_greedy"] = spec
        res["vram_mb"] = m.vram_usage_mb()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-407m", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "copy_bandwidth_bytes_per_s": copy_bandwidth(),
    }
    print("copy bandwidth", results["copy_bandwidth_bytes_per_s"] / 1e12, "TB/s", flush=True)
    results["tiny"] = bench_model("tiny", 8, rng, [(1, 4), (2, 8), (4, 16)])
    print("tiny", json.dumps(results["tiny"]), flush=True)
    if not args.skip_407m:
        path = "/tmp/seed-407m.tinyloop"
        if not Path(path).exists():
            subprocess.run(
                [sys.executable, "-m", "tinyloop.cli.convert", "--random", "--preset", "seed-407m", "-o", path,
                 "--bits", "4"], check=True,
            )  # fmt: skip
        results["seed-407m"] = bench_model(path, 8, rng, [(2, 8)])
        print("seed-407m", json.dumps(results["seed-407m"]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
