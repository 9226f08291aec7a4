"""Self-speculative decoding against plain greedy decoding on one CUDA device, per request: several random prompts,
each timed several times (the first speculative request of a process also captures the verification graphs, one
per row count, so it is reported but not representative), with the policy's statistics (plain steps taken,
verification passes, drafted and accepted tokens, time in drafts, verification and plain steps). Optionally
again with the CUDA prior's cost of a further verification token replaced (`runtime/spec_costs.py`).

    PYTHONPATH=src python bench/gpu_speculative.py --model seed.tinyloop --out F.json [--prompts 3] [--repeats 3] \\
        [--extra-token-costs 0.45 0.1]

Results of 2026-12-07 (H100): bench/results/h100_spec_adaptive.json, docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import tinyloop
from tinyloop.runtime import spec_costs

TOKENS = 128
PROMPT_TOKENS = 128


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-loops", type=int, default=2)
    parser.add_argument("--verify-loops", type=int, default=8)
    parser.add_argument("--extra-token-costs", type=float, nargs="*", default=[],
                        help="CUDA priors of a further verification token (default: the shipped one)")  # fmt: skip
    args = parser.parse_args()
    model = tinyloop.Model(args.model, max_seq_len=512, device="cuda")
    vocab = min(30000, int(model.config["vocab_size"]))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, vocab, PROMPT_TOKENS).astype(np.int32) for _ in range(args.prompts)]
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    shipped = spec_costs.EXTRA_TOKEN_COST_BY_DEVICE["cuda"]
    for prior in args.extra_token_costs or [shipped]:
        spec_costs.EXTRA_TOKEN_COST_BY_DEVICE["cuda"] = prior
        for index, prompt in enumerate(prompts):
            model.generate(prompt, TOKENS, loops=args.verify_loops, temperature=0.0)
            for repeat in range(args.repeats):
                plain_s, plain = timed(
                    lambda p=prompt: model.generate(p, TOKENS, loops=args.verify_loops, temperature=0.0)
                )
                run: dict = {"prior": prior, "prompt": index, "rep": repeat, "plain_ms": round(plain_s * 1e3, 1)}
                for adaptive in (True, False):
                    s, tokens = timed(lambda p=prompt, a=adaptive: model.generate_speculative(
                        p, TOKENS, draft_loops=args.draft_loops, verify_loops=args.verify_loops, temperature=0.0,
                        adaptive=a).tokens)  # fmt: skip
                    stats = model.last_speculative_stats
                    run["adaptive" if adaptive else "fixed"] = {
                        "ms": round(s * 1e3, 1), "x": round(plain_s / s, 3),
                        "equal": bool(np.array_equal(np.asarray(tokens), np.asarray(plain))),
                        "plain_steps": stats.plain_steps, "verify_passes": stats.verify_passes,
                        "drafted": stats.drafted, "accepted": stats.accepted,
                        "draft_ms": round(stats.draft_s * 1e3, 1), "verify_ms": round(stats.verify_s * 1e3, 1),
                        "plain_step_ms": round(stats.plain_s * 1e3, 1), "agreement": stats.prompt_agreement,
                    }  # fmt: skip
                result["runs"].append(run)
                print(json.dumps(run), flush=True)
    spec_costs.EXTRA_TOKEN_COST_BY_DEVICE["cuda"] = shipped
    model.close()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
