"""CPU decode speed: TinyLoop's engine against a plain PyTorch implementation of the same looped model.

    python bench/cpu_decode_vs_plain.py [--model tiny] [--loops 8] [--tokens 128] [--repeat 3] [--json]

Both decode greedily from the same prompt at the same loop count, in one process, runs interleaved so
machine noise hits both alike. TinyLoop runs twice: float32 (the default) and `dtype=torch.bfloat16`
(INT4 matmuls through torch's CPU INT4 kernel, everything else float32; --no-bf16 skips it). The prefill
yields the first token; tokens/s counts the tokens - 1 cached decode steps after it (as
`GenerationStats.decode_tokens_per_s`). Exit status 1 when the greedy tokens differ within the first
--check tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import numpy as np
import torch
from plain_torch_looped import PlainLoopedLM, greedy_generate  # bench/ is on sys.path when run as a script

import tinyloop
from tinyloop.builtin import resolve_model
from tinyloop.runtime import cpu_decode

DEFAULT_PROMPT = "def fibonacci(n):\n"
BF16 = "tinyloop, bfloat16 matmuls"


Run = tuple[list[int], float, float]  # greedy tokens, prefill seconds, decode seconds


def tinyloop_run(model: tinyloop.Model, prompt: list[int], tokens: int, loops: int) -> Run:
    out = model.generate(np.array(prompt, dtype=np.int32), tokens, loops, temperature=0.0)
    s = model.last_stats
    return [int(t) for t in out], s.prefill_s, s.decode_s


def tinyloop_all_threads_run(model: tinyloop.Model, prompt: list[int], tokens: int, loops: int) -> Run:
    """tinyloop_run with decode steps on torch's threads (the runtime runs steps of <= 8 rows on one)."""
    previous = cpu_decode.SINGLE_THREAD_ROWS
    cpu_decode.SINGLE_THREAD_ROWS = 0
    try:
        return tinyloop_run(model, prompt, tokens, loops)
    finally:
        cpu_decode.SINGLE_THREAD_ROWS = previous


def plain_run(model: PlainLoopedLM, prompt: list[int], tokens: int, loops: int, threads: int | None = None) -> Run:
    """threads: torch's thread count for this run only (None: leave it as it is)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        g = greedy_generate(model, prompt, tokens, loops)
    finally:
        torch.set_num_threads(previous)
    return g.tokens, g.prefill_s, g.decode_s


def summarise(runs: list[Run], tokens: int) -> dict[str, float | list[float]]:
    prefill = statistics.median(r[1] for r in runs)
    decode = statistics.median(r[2] for r in runs)
    steps = tokens - 1
    return {
        "prefill_ms": 1e3 * prefill,
        "decode_ms_total": 1e3 * decode,
        "decode_ms_per_token": 1e3 * decode / steps,
        "decode_tokens_per_s": steps / decode,
        "decode_ms_runs": [1e3 * r[2] for r in runs],
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="built-in name or .tinyloop path (default: tiny)")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="tokens to generate (default: 128)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each (default: 3)")
    ap.add_argument("--check", type=int, default=32, help="greedy tokens that must agree (default: 32)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for all (default: torch's)")
    ap.add_argument("--no-bf16", action="store_true", help="skip TinyLoop's bfloat16-matmul run")
    ap.add_argument(
        "--bf16-all-threads", action="store_true",
        help="also time the bfloat16 run with decode steps on all of torch's threads (the runtime uses one)",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    if args.loops < 1 or args.tokens < 2 or args.repeat < 1 or args.check < 1:
        ap.error("--loops, --repeat and --check must be >= 1, --tokens >= 2")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    prompt = list(args.prompt.encode("utf-8"))
    threads = torch.get_num_threads()

    tl_model = tinyloop.Model(path, max_seq_len=len(prompt) + args.tokens, device="cpu")
    plain = PlainLoopedLM.from_tinyloop(path)
    # name -> one greedy generation of n tokens. The plain model runs at torch's thread count, as a user's
    # would, and at one thread (TinyLoop's engine runs small decode steps on one thread).
    impls = {"tinyloop": lambda n: tinyloop_run(tl_model, prompt, n, args.loops)}
    bf16_model = None
    if not args.no_bf16:
        bf16_model = tinyloop.Model(path, max_seq_len=len(prompt) + args.tokens, device="cpu", dtype=torch.bfloat16)
        impls[BF16] = lambda n: tinyloop_run(bf16_model, prompt, n, args.loops)
        if args.bf16_all_threads and threads > 1:
            impls[f"{BF16}, {threads} threads"] = lambda n: tinyloop_all_threads_run(bf16_model, prompt, n, args.loops)
    plain_name = f"plain PyTorch, {threads} threads"
    impls[plain_name] = lambda n: plain_run(plain, prompt, n, args.loops)
    if threads > 1:
        impls["plain PyTorch, 1 thread"] = lambda n: plain_run(plain, prompt, n, args.loops, threads=1)
    for run in impls.values():  # warm-up: first calls allocate, fill caches, compile any compiled path
        run(8)
    runs: dict[str, list[Run]] = {name: [] for name in impls}
    for _ in range(args.repeat):  # interleaved, so machine noise hits every implementation alike
        for name, run in impls.items():
            runs[name].append(run(args.tokens))
    tl_model.close()
    if bf16_model is not None:
        bf16_model.close()

    n_check = min(args.check, args.tokens)
    reference = runs["tinyloop"][0][0]
    results = {}
    agree = True
    for name, rs in runs.items():
        diff = first_difference(reference, rs[0][0])
        ok = diff is None or diff >= n_check
        agree &= ok
        results[name] = {
            **summarise(rs, args.tokens),
            "greedy_agrees_with_tinyloop": ok,
            "matching_prefix": args.tokens if diff is None else diff,
        }
    tl_ms = results["tinyloop"]["decode_ms_per_token"]
    plain_ms = results[plain_name]["decode_ms_per_token"]
    for res in results.values():
        res["tinyloop_speedup"] = res["decode_ms_per_token"] / tl_ms
        res["speedup_over_plain"] = plain_ms / res["decode_ms_per_token"]
    report = {
        "model": path.name,
        "loops": args.loops,
        "prompt_tokens": len(prompt),
        "tokens": args.tokens,
        "repeat": args.repeat,
        "threads": threads,
        "torch_version": torch.__version__,
        "tinyloop_version": tinyloop.__version__,
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "greedy_check_tokens": n_check,
        "greedy_agree": agree,
        "implementations": results,
    }
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if agree else 1


def render(r: dict) -> str:
    lines = [
        f"{r['model']}, loops {r['loops']}, prompt {r['prompt_tokens']} tokens, {r['tokens']} new tokens, "
        f"CPU {r['processor']}, torch {r['torch_version']}, median of {r['repeat']} runs",
        f"{'implementation':<38}{'prefill ms':>11}{'decode ms/token':>17}{'decode tokens/s':>17}"
        f"{'faster than plain':>19}{'greedy = tinyloop':>19}",
    ]
    for name, m in r["implementations"].items():
        same = f"{m['matching_prefix']}/{r['tokens']} tokens"
        lines.append(
            f"{name:<38}{m['prefill_ms']:>11.1f}{m['decode_ms_per_token']:>17.2f}{m['decode_tokens_per_s']:>17.1f}"
            f"{m['speedup_over_plain']:>18.2f}x{same:>19}"
        )
    verdict = "yes" if r["greedy_agree"] else "NO"
    lines.append(f"greedy tokens agree on the first {r['greedy_check_tokens']}: {verdict}")
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
