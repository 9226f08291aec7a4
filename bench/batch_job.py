"""`tinyloop MODEL batch` throughput against `Model.generate` called row by row over the same rows (and,
with --ray-replicas, the same job over Ray Data with N replicas on this machine). Every row's tokens are
checked equal between the runs. Prints one JSON object; wall clock and process CPU seconds (a shared
machine's other jobs inflate wall clock)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tinyloop
from tinyloop.jobs import JobSettings
from tinyloop.jobs.local import iter_results, run_job


def cpu_seconds() -> float:
    """This process and its finished children (Ray workers are not counted: see --ray-replicas)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--loops", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared VM two threads slow both paths unevenly)",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--ray-replicas", default="", help="comma-separated replica counts for a Ray Data run each")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    words = "the loop runs over a model of shared layers and each pass refines the state".split()
    prompts = [" ".join(rng.choice(words, size=int(rng.integers(3, 9)))) for _ in range(a.rows)]
    settings = JobSettings(max_tokens=a.max_tokens, loops=a.loops, max_batch=a.max_batch)
    torch.set_num_threads(a.threads)
    model = tinyloop.Model(a.model, max_seq_len=256, dtype=getattr(torch, a.dtype))
    model.generate(list(b"warm up"), 4, a.loops, temperature=0)

    t0, c0 = time.perf_counter(), cpu_seconds()
    loop_out = [model.generate(list(s.encode()), a.max_tokens, a.loops, temperature=0).tolist() for s in prompts]
    loop_s, loop_cpu = time.perf_counter() - t0, cpu_seconds() - c0
    tokens = sum(len(t) for t in loop_out)

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "in.jsonl"
        source.write_text("".join(json.dumps({"prompt": s}) + "\n" for s in prompts), encoding="utf-8")
        t0, c0 = time.perf_counter(), cpu_seconds()
        run_job(model, source, Path(tmp) / "out", settings, progress=False)
        batch_s, batch_cpu = time.perf_counter() - t0, cpu_seconds() - c0
        batch_out = [r["tokens"] for r in iter_results(Path(tmp) / "out")]
        rows_equal = sum(b == g for b, g in zip(batch_out, loop_out, strict=True))
        ray_runs = []
        for replicas in [int(x) for x in a.ray_replicas.split(",") if x]:
            ray_runs.append(ray_run(a, source, Path(tmp) / f"ray{replicas}", settings, replicas, loop_out))

    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, tinyloop {tinyloop.__version__}",
        "load_average_at_end": os.getloadavg(),
        "dtype": a.dtype, "rows": a.rows, "max_tokens": a.max_tokens, "loops": a.loops, "max_batch": a.max_batch,
        "tokens": tokens,
        "generate_loop": {"wall_s": loop_s, "cpu_s": loop_cpu, "tokens_per_s": tokens / loop_s},
        "batch_job": {"wall_s": batch_s, "cpu_s": batch_cpu, "tokens_per_s": tokens / batch_s},
        "rows_equal_to_generate": rows_equal,
        "speedup_wall": loop_s / batch_s, "speedup_cpu": loop_cpu / batch_cpu,
        "ray": ray_runs,
    }  # fmt: skip
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n", encoding="utf-8")


def ray_run(a, source: Path, out: Path, settings: JobSettings, replicas: int, expected: list) -> dict:
    import pyarrow.parquet as pq
    import ray

    from tinyloop.integrations.ray import run_ray_job

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        t0 = time.perf_counter()
        options = {"max_seq_len": 256, "dtype": getattr(torch, a.dtype)}
        run_ray_job(a.model, source, out, settings, model_options=options, replicas=replicas,
                    batch_rows=max(8, a.rows // (2 * replicas)))  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["row"])
    assert [r["tokens"] for r in rows] == expected, "the Ray job's tokens differ from generate's"
    tokens = sum(len(t) for t in expected)
    return {"replicas": replicas, "wall_s": wall, "tokens_per_s": tokens / wall}


if __name__ == "__main__":
    main()
