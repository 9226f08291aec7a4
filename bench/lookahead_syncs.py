"""Host work per greedy token on a GPU: engine steps, host waits and decode time, through the public API only, so
the same script checks this tree and an older checkout (`PYTHONPATH=<tree>/src`).

For `generate` (B=1) and `generate_batch` (B=4), greedy, each count is per new token: (count for 1 + N tokens -
count for 1 token) / N. Counted: `Engine.step` calls, `torch.cuda.Event.synchronize` calls (the decode loop's
wait for the tokens it queued), and the synchronising CUDA calls torch's sync debug mode reports. With the host one
step ahead (runtime/decode.py) each is 1, 1 and 0; without it the step count is the same and each token syncs
through its sampling instead of an event. Where the tree has `Engine.lookahead`, the same is run again with it
off (the loop without lookahead, on the same GPU) for the time per token.

    PYTHONPATH=src python bench/lookahead_syncs.py [--model tiny] [--tokens 64] [--loops 8] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import tinyloop
from tinyloop.runtime.engine import Engine

PROMPTS = [list(b"def fibonacci(n):"), list(b"import os\nimport sys\n"), list(b"class Stack:"), list(b"The loop")]


def _counted(run: Callable[[int], object]) -> Callable[[int], dict[str, int]]:
    """run(n) under counters of engine steps, event waits and synchronising calls."""

    def counts(n: int) -> dict[str, int]:
        c = {"steps": 0, "event_waits": 0, "syncs": 0}
        step, wait = Engine.step, torch.cuda.Event.synchronize

        def counted_step(self: Engine, *args: Any, **kwargs: Any) -> Any:
            c["steps"] += 1
            return step(self, *args, **kwargs)

        def counted_wait(self: torch.cuda.Event) -> None:
            c["event_waits"] += 1
            wait(self)

        Engine.step, torch.cuda.Event.synchronize = counted_step, counted_wait  # type: ignore[method-assign]
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run(n)
            c["syncs"] = sum("synchronizing" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            Engine.step, torch.cuda.Event.synchronize = step, wait  # type: ignore[method-assign]
        return c

    return counts


def _per_token(run: Callable[[int], object], tokens: int) -> dict[str, float]:
    counts = _counted(run)
    one, many = counts(1), counts(1 + tokens)
    return {name: (many[name] - one[name]) / tokens for name in one}


def _ms_per_token(run: Callable[[int], object], tokens: int, repeats: int = 7) -> float:
    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    one = statistics.median(timed(1) for _ in range(repeats))
    many = statistics.median(timed(1 + tokens) for _ in range(repeats))
    return 1e3 * (many - one) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a .tinyloop file or a built-in name")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--loops", type=int, default=8)
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this check needs a CUDA device")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tinyloop.Model(args.model, device="cuda") as m:

        def one(n: int) -> object:
            return m.generate(PROMPTS[0], n, loops=args.loops, temperature=0.0)

        def batch(n: int) -> object:
            return m.generate_batch(PROMPTS, n, loops=args.loops, temperature=0.0)

        one(8), batch(8)  # compile, capture graphs
        modes = [True, False] if hasattr(m._engine, "lookahead") else [None]
        for mode in modes:
            if mode is not None:
                m._engine.lookahead = mode
            label = {True: "lookahead", False: "plain", None: "tree_default"}[mode]
            for name, run in (("B1", one), ("B4", batch)):
                entry = _per_token(run, args.tokens)
                entry["ms_per_token"] = _ms_per_token(run, args.tokens)
                results[f"{label}_{name}"] = entry
                print(f"{label:12s} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
