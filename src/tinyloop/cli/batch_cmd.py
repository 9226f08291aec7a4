"""`tinyloop MODEL batch IN OUT`: a task over every row of a JSONL or Parquet file into a folder of Parquet
shards (tinyloop.jobs), resumable; with --ray the same task over a Ray cluster."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tinyloop.cli.args import (
    CliError,
    Parser,
    add_device_arguments,
    loop_count,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    torch_dtype,
)

TASK_HELP = ("generate: text and tokens; score: total log-likelihood and per-token logprobs; lens: top-1 and "
             "entropy after each loop at every position; uncertainty: KL between consecutive depths and the "
             "depth from which the top-1 stops changing")  # fmt: skip


def build_parser() -> Parser:
    p = Parser(prog="tinyloop batch", description="Run a task over every row of IN (JSONL or Parquet with a "
               "'prompt' or 'tokens' column and optional per-row max_tokens, loops, temperature, seed, id) and "
               "write the results to the folder OUT as Parquet shards; bad rows go to OUT/_errors.jsonl.")  # fmt: skip
    p.add_argument("input", metavar="IN", help="input rows: .jsonl or .parquet")
    p.add_argument("output", metavar="OUT", help="output folder (part-*.parquet, _errors.jsonl, _job.json)")
    p.add_argument("--task", choices=("generate", "score", "lens", "uncertainty"), default="generate", help=TASK_HELP)
    p.add_argument("--max-tokens", type=non_negative_int, default=16, help="new tokens per row (default: 16)")
    p.add_argument("--loops", type=loop_count, default=None, help="loops per row (default: the model's)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-k", type=non_negative_int, default=50, help="0 disables (default: 50)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="a sampled row without its own seed uses seed + its row index (default: 0)")  # fmt: skip
    p.add_argument("--max-batch", type=positive_int, default=8, help="rows decoded together (default: 8)")
    p.add_argument("--shard-rows", type=positive_int, default=256, help="input rows per output shard (default: 256)")
    p.add_argument("--resume", action="store_true", help="finish an interrupted job in OUT (same model and options)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--max-seq-len", type=positive_int, default=None, help="positions per row (default: the model's)")
    add_device_arguments(p)
    p.add_argument("--ray", action="store_true", help="run over a Ray cluster through Ray Data (the 'ray' extra)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the cluster to join (default: RAY_ADDRESS, else a local Ray instance)")  # fmt: skip
    p.add_argument("--replicas", type=positive_int, default=1, help="with --ray: model replicas (actors; default: 1)")
    p.add_argument("--num-gpus", type=non_negative_float, default=0.0, help="with --ray: GPUs per replica (default: 0)")
    return p


def run_batch(path: str, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if importlib.util.find_spec("pyarrow") is None:
        raise CliError("tinyloop batch needs pyarrow: pip install 'loopformer[parquet]'", code=1)
    if not args.ray and (args.ray_address is not None or args.replicas != 1 or args.num_gpus):
        raise CliError("--ray-address, --replicas and --num-gpus need --ray")
    from tinyloop.jobs import JobSettings
    from tinyloop.jobs.local import MANIFEST

    if not args.resume and (Path(args.output) / MANIFEST).exists():
        raise CliError(f"{args.output}: already holds a job; pass --resume to finish it, or choose a new folder")

    settings = JobSettings(task=args.task, max_tokens=args.max_tokens, loops=args.loops,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           max_batch=args.max_batch)  # fmt: skip
    model_options = {"max_seq_len": args.max_seq_len, "device": args.device,
                     "dtype": torch_dtype(args.dtype, args.device)}  # fmt: skip
    if args.ray:
        if importlib.util.find_spec("ray") is None:
            raise CliError("--ray needs the 'ray' extra: pip install 'loopformer[ray]'", code=1)
        if args.resume:
            raise CliError("--resume is for local jobs; a Ray job writes its output folder in one pass")
        from tinyloop.integrations.ray import run_ray_job

        summary = run_ray_job(path, args.input, args.output, settings, model_options=model_options,
                              replicas=args.replicas, num_gpus=args.num_gpus, address=args.ray_address)  # fmt: skip
    else:
        from tinyloop.api.model import Model
        from tinyloop.jobs.local import run_job

        with Model(path, **model_options) as model:
            summary = run_job(model, args.input, args.output, settings, shard_rows=args.shard_rows,
                              resume=args.resume, progress=not args.no_progress)  # fmt: skip
    print(f"tinyloop batch: {summary.results} rows written to {args.output}, {summary.errors} in "
          f"{args.output}/_errors.jsonl ({summary.rows} read, {summary.seconds:.1f} s)", file=sys.stderr)  # fmt: skip
    return 0
