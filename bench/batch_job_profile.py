"""Where `bench/batch_job.py`'s time goes, in process time: its generate loop and its batch job with every
`Engine.step` timed (decode steps by rows, prefills), and one decode step at 1 and 8 rows timed alone, in slots
of the job's size and of 256 positions, with and without the attention core (scores, softmax, weighted values:
wrong logits, for its share of a step). Prints one JSON object.

    python bench/batch_job_profile.py [--dtype bfloat16] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import tinyloop
from tinyloop.jobs import JobSettings
from tinyloop.jobs.local import run_job
from tinyloop.runtime.cpu_decode import CpuDecoder
from tinyloop.runtime.engine import Engine

# Rows of an 8-row step at the positions of a job's rows (prompts of 20-60 bytes, some tokens in).
POSITIONS = [60, 75, 52, 88, 70, 64, 58, 85]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)  # the prompts of bench/batch_job.py --rows 48
    words = "the loop runs over a model of shared layers and each pass refines the state".split()
    prompts = [" ".join(rng.choice(words, size=int(rng.integers(3, 9)))) for _ in range(48)]
    model = tinyloop.Model("tiny", max_seq_len=256, dtype=getattr(torch, a.dtype))
    model.generate(list(b"warm up"), 4, 8, temperature=0)
    result: dict[str, object] = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, 1 thread",
        "dtype": a.dtype,
        "load_average_at_start": os.getloadavg(),
    }
    with timed_steps() as steps:
        t0 = time.process_time()
        for s in prompts:
            model.generate(list(s.encode()), 32, 8, temperature=0)
        result["generate_loop"] = summary(steps, time.process_time() - t0)
    settings = JobSettings(max_tokens=32, loops=8, max_batch=8)
    with tempfile.TemporaryDirectory() as tmp, timed_steps() as steps:
        source = Path(tmp) / "in.jsonl"
        source.write_text("".join(json.dumps({"prompt": s}) + "\n" for s in prompts), encoding="utf-8")
        t0 = time.process_time()
        run_job(model, source, Path(tmp) / "out", settings, progress=False)
        result["batch_job"] = summary(steps, time.process_time() - t0)
    result["decode_step_ms"] = step_variants(model._engine, a.rounds)
    result["load_average_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))


class timed_steps:
    """Process seconds and counts of Engine.step calls by kind: ('decode', rows) or ('prefill', 1)."""

    def __enter__(self) -> dict[tuple[str, int], list[float]]:
        self.original = Engine.step
        self.times: dict[tuple[str, int], list[float]] = defaultdict(list)
        original, times = self.original, self.times

        def step(engine: Engine, tokens: torch.Tensor, *args: object, **kwargs: object) -> object:
            t0 = time.process_time()
            out = original(engine, tokens, *args, **kwargs)  # type: ignore[arg-type]
            B, T = tokens.shape
            times[("decode", B) if T == 1 else ("prefill", B)].append(time.process_time() - t0)
            return out

        Engine.step = step  # type: ignore[method-assign, assignment]
        return self.times

    def __exit__(self, *exc: object) -> None:
        Engine.step = self.original  # type: ignore[method-assign]


def summary(steps: dict[tuple[str, int], list[float]], total: float) -> dict[str, object]:
    out: dict[str, object] = {"total_s": total}
    for (kind, rows), t in sorted(steps.items()):
        out[f"{kind}_{rows}_rows"] = {"calls": len(t), "s": sum(t), "ms_each": 1e3 * sum(t) / len(t),
                                      "share": sum(t) / total}  # fmt: skip
    out["outside_engine_steps_s"] = total - sum(sum(t) for t in steps.values())
    return out


def step_variants(engine: Engine, rounds: int) -> dict[str, dict[str, float]]:
    """ms per decode step: rows at POSITIONS (one row: 80) in slots of 96 (the job's size here) or 256
    positions, with the whole attention or only its QKV product, RoPE and cache write."""
    full = CpuDecoder._attention

    def no_core(self: CpuDecoder, h, lp, cache, slot, st, buf) -> None:  # noqa: ANN001
        self._qkv_rope(h, lp, st, buf)
        self._store_new_kv(cache, slot, st, buf)

    def ms(batch: int, slots: int, attention: bool, steps: int = 20) -> float:
        with mock.patch.object(CpuDecoder, "_attention", full if attention else no_core):
            cache = engine.new_cache(batch, slots, 8)
            tokens = torch.randint(0, 256, (batch, 1), generator=torch.Generator().manual_seed(0))
            lengths = torch.tensor(POSITIONS[:batch] if batch > 1 else [80])
            cache.lengths = lengths.clone()
            engine.step(tokens, cache, 8, last_only=True)
            t0 = time.process_time()
            for _ in range(steps):
                cache.lengths = lengths.clone()
                engine.step(tokens, cache, 8, last_only=True)
            return (time.process_time() - t0) / steps * 1e3

    variants = [(b, s, att) for b in (1, 8) for s in (96, 256) for att in (True, False)]
    times: dict[tuple[int, int, bool], list[float]] = {v: [] for v in variants}
    for r in range(rounds + 1):  # interleaved; the first round warms up
        for v in variants:
            step = ms(*v)
            if r:
                times[v].append(step)
    out: dict[str, dict[str, float]] = {}
    for (b, s, att), runs in times.items():
        out.setdefault(f"{b}_rows", {})[f"slots_{s}{'' if att else '_no_attention_core'}"] = statistics.median(runs)
    return out


if __name__ == "__main__":
    main()
