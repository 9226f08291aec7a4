"""Batched decode on one CUDA device through the public API: per-step time and aggregate decode tokens/s at
several batch sizes (`Model.generate_batch_stream`, greedy, random prompts of 128 tokens (`--prompt-tokens`),
64 timed steps after every row's first token, median of 3), optionally a kernel profile per batch size, batched
greedy rows against each prompt alone in float32 and bfloat16, and self-speculation (draft 2 / verify 8) against
plain greedy decoding. Runs on an older checkout too (`PYTHONPATH=<tree>/src`), so a baseline shares the machine.

    PYTHONPATH=src python bench/gpu_batched_decode.py --model seed.tinyloop --out seed.json \\
        [--batches 1 2 4 8 16 32 64] [--loops 8] [--prompt-tokens 128] [--profile 2 64] [--agree] [--speculative] \\
        [--policy gluon_gemv_max_rows=1 dense_copy_min_rows=2] [--tiles rows.json] \\
        [--mma-tiles 6144,2048,32=8,1,128,32]

--policy, --tiles and --mma-tiles load the model under a KernelPolicy with those fields replaced (--tiles: the
`best_tiles` of bench/gluon_gemv_rows.py as `gluon_tiles`; --mma-tiles: `mma_int4_tiles`), to compare kernel
choices on one machine.

Results of 2026-12-06 (H100): bench/results/h100_batched_decode.json, docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from gpu_speculative import timed
from gpu_suite import policy_overrides

import tinyloop

PROMPT_TOKENS = 128
STEPS = 64


def random_prompts(rng: np.random.Generator, rows: int, vocab: int, length: int = PROMPT_TOKENS) -> list[np.ndarray]:
    return [rng.integers(1, vocab, length).astype(np.int32) for _ in range(rows)]


def timed_batch(model: tinyloop.Model, prompts: list[np.ndarray], steps: int, loops: int) -> tuple[float, float]:
    """(seconds until every row has its first token, seconds per later step)."""
    seen, first = 0, 0.0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in model.generate_batch_stream(prompts, max_tokens=steps + 1, loops=loops, temperature=0.0):
        seen += 1
        if seen == len(prompts):
            first = time.perf_counter()
    torch.cuda.synchronize()
    return first - t0, (time.perf_counter() - first) / steps


def kernel_profile(model: tinyloop.Model, prompts: list[np.ndarray], loops: int) -> list[tuple[str, float, int]]:
    """The 12 kernels (and ops) with the most device time over a 16-step run, prefill included."""
    from torch.profiler import ProfilerActivity, profile

    timed_batch(model, prompts, 4, loops)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        timed_batch(model, prompts, 16, loops)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    return [(e.key[:70], round(e.device_time_total / 1e3, 2), e.count) for e in events[:12]]


def parse_overrides(pairs: list[str], tiles: str | None) -> dict:
    fields: dict = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if "," in value:
            fields[key] = tuple(int(v) for v in value.split(","))
        else:
            fields[key] = int(value) if value.lstrip("-").isdigit() else value
    if tiles:
        with open(tiles) as f:
            best = json.load(f)["best_tiles"]
        fields["gluon_tiles"] = {tuple(int(v) for v in k.split(",")): tuple(t) for k, t in best.items()}
    return fields


def leading_equal(a: np.ndarray, b: np.ndarray) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def batched_vs_alone(path: str, loops: int, vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(1)
    # 2-64 rows: the tensor-core INT4 kernel's range on Hopper in bfloat16.
    prompts = [rng.integers(1, vocab, n).astype(np.int32) for n in (20, 57, 128, 90, *rng.integers(16, 160, 60))]
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tinyloop.Model(path, max_seq_len=512, device="cuda", dtype=dtype)
        alone = [model.generate(p, 32, loops=loops, temperature=0.0) for p in prompts]
        for rows in (2, 4, 8, 16, 32, 64):
            batch = model.generate_batch(prompts[:rows], max_tokens=32, loops=loops, temperature=0.0)
            name = str(dtype).removeprefix("torch.")
            result[f"{name}_B{rows}"] = [leading_equal(a, b) for a, b in zip(alone, batch, strict=False)]
        model.close()
    return result


def speculative(model: tinyloop.Model, vocab: int) -> dict:
    prompt = random_prompts(np.random.default_rng(2), 1, vocab)[0]

    def median_s(fn):  # type: ignore[no-untyped-def]
        fn()
        runs = [timed(fn) for _ in range(3)]
        return statistics.median(s for s, _ in runs), runs[-1][1]

    plain_s, plain = median_s(lambda: model.generate(prompt, 128, loops=8, temperature=0.0))
    result: dict = {"plain_128_tokens_ms": plain_s * 1e3}
    for adaptive in (True, False):
        s, spec = median_s(lambda a=adaptive: model.generate_speculative(
            prompt, 128, draft_loops=2, verify_loops=8, temperature=0.0, adaptive=a).tokens)  # fmt: skip
        result["adaptive" if adaptive else "fixed"] = {
            "ms": s * 1e3, "vs_plain": plain_s / s, "leading_tokens_equal_to_plain": leading_equal(plain, spec)
        }  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--loops", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="tokens of each random prompt")
    parser.add_argument("--profile", type=int, nargs="*", default=[], help="batch sizes to profile")
    parser.add_argument("--agree", action="store_true", help="batched greedy rows against each prompt alone")
    parser.add_argument("--speculative", action="store_true", help="draft 2 / verify 8 against plain greedy")
    parser.add_argument("--policy", nargs="*", default=[], help="KernelPolicy fields to replace, as FIELD=VALUE")
    parser.add_argument("--tiles", help="bench/gluon_gemv_rows.py output whose best tiles the policy takes")
    parser.add_argument(
        "--mma-tiles", nargs="*", default=[], metavar="N,K,ROWS=W,R,BK,MP",
        help="tensor-core INT4 tiles (warps, row tiles, BLOCK_K, x rows) for N x K at ROWS rows",
    )  # fmt: skip
    args = parser.parse_args()
    fields = parse_overrides(args.policy, args.tiles)
    if args.mma_tiles:
        fields["mma_int4_tiles"] = parse_mma_tiles(args.mma_tiles)
    with policy_overrides(fields):
        run(args)


def parse_mma_tiles(specs: list[str]) -> dict[tuple[int, ...], tuple[int, ...]]:
    """["6144,2048,32=8,1,128,32"] -> {(6144, 2048, 32): (8, 1, 128, 32)} (KernelPolicy.mma_int4_tiles)."""
    tiles = {}
    for spec in specs:
        shape, _, tile = spec.partition("=")
        key, value = tuple(int(v) for v in shape.split(",")), tuple(int(v) for v in tile.split(","))
        if len(key) != 3 or len(value) != 4:
            raise SystemExit(f"--mma-tiles: expected N,K,ROWS=WARPS,ROW_TILES,BLOCK_K,X_ROWS, got {spec!r}")
        tiles[key] = value
    return tiles


def run(args: argparse.Namespace) -> None:
    model = tinyloop.Model(args.model, max_seq_len=max(512, args.prompt_tokens + STEPS + 8), device="cuda")
    vocab = min(30000, int(model.config["vocab_size"]))
    rng = np.random.default_rng(0)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "loops": args.loops,
                    "prompt_tokens": args.prompt_tokens, "policy": args.policy, "tiles": args.tiles,
                    "mma_tiles": args.mma_tiles, "rows": {}}  # fmt: skip
    for rows in args.batches:
        prompts = random_prompts(rng, rows, vocab, args.prompt_tokens)
        timed_batch(model, prompts, 4, args.loops)
        runs = [timed_batch(model, prompts, STEPS, args.loops) for _ in range(3)]
        step = statistics.median(r[1] for r in runs)
        result["rows"][rows] = {
            "step_ms": round(step * 1e3, 3),
            "first_token_ms": round(statistics.median(r[0] for r in runs) * 1e3, 1),
            "decode_tokens_per_s": round(rows / step, 1),
        }
        print(rows, result["rows"][rows], flush=True)
    for rows in args.profile:
        result.setdefault("profile", {})[rows] = kernel_profile(model, random_prompts(rng, rows, vocab), args.loops)
    if args.speculative:
        result["speculative_2_8"] = speculative(model, vocab)
    model.close()
    if args.agree:
        result["batched_vs_alone_leading_equal_of_32"] = batched_vs_alone(args.model, args.loops, vocab)
    result["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "profile")}), flush=True)


if __name__ == "__main__":
    main()
