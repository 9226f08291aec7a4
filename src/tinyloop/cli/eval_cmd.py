"""`tinyloop <model> eval --tasks ...`: lm-evaluation-harness tasks at one depth or a sweep of depths."""

from __future__ import annotations

import sys
from pathlib import Path

from tinyloop.cli.args import (
    CliError,
    Parser,
    add_dtype_argument,
    loops_list,
    non_negative_float,
    positive_int,
    torch_dtype,
)

EXIT_CRITERIA = ("kl", "entropy", "argmax", "latent", "gate")
KV_MODES = ("16bit", "int8", "window", "hidden", "none")


def build_parser() -> Parser:
    p = Parser(
        prog="tinyloop eval",
        description="Run lm-evaluation-harness tasks (offline, from local task files) at one or several depths.",
    )
    p.add_argument("--tasks", required=True, help="comma-separated task names (shipped: python_snippets)")
    p.add_argument("--loops", type=loops_list, default=None, help="depth or sweep, e.g. 1,2,4,8 (default: model's)")
    p.add_argument("--limit", type=positive_int, default=None, help="evaluate only the first N documents per task")
    p.add_argument("--output", default=None, metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--plot-dir", default=None, metavar="DIR", help="write one metric-vs-loops PNG per task here")
    p.add_argument("--include-path", default=None, metavar="DIR", help="more lm-eval task YAMLs (local data)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="requests scored together (default: 16)")
    p.add_argument("--exit-threshold", type=non_negative_float, default=None, help="Ouro's exit CDF threshold")
    p.add_argument("--exit-criterion", choices=EXIT_CRITERIA, default=None, help="per-token early exit rule")
    p.add_argument("--exit-tol", type=non_negative_float, default=None, help="the criterion's threshold")
    p.add_argument("--kv-mode", choices=KV_MODES, default=None, help="KV cache of generation tasks")
    p.add_argument("--max-length", type=positive_int, default=None, help="tokens per request (default: the model's)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    add_dtype_argument(p)
    return p


def run_eval(path: str, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise CliError("--tasks must name at least one task")
    if args.exit_tol is not None and args.exit_criterion is None:
        raise CliError("--exit-tol sets the threshold of --exit-criterion, which was not given")
    if args.plot_dir is not None and not Path(args.plot_dir).is_dir():
        raise CliError(f"--plot-dir {args.plot_dir!r} is not a directory")
    if args.plot_dir is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError("--plot-dir needs matplotlib (pip install 'loopformer[plot]')") from None
    try:
        from tinyloop.integrations.sweep import format_table, plot_sweep, run_sweep, write_json
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "lm_eval":
            raise
        raise CliError("eval needs lm-evaluation-harness (pip install 'loopformer[eval]')", code=1) from None
    if args.output is not None and not Path(args.output).absolute().parent.is_dir():
        raise CliError(f"--output {args.output!r}: its directory does not exist")
    result = run_sweep(
        path, tasks, args.loops, limit=args.limit, include_path=args.include_path, batch_size=args.batch_size,
        exit_threshold=args.exit_threshold, exit_criterion=args.exit_criterion, exit_tol=args.exit_tol,
        kv_mode=args.kv_mode, max_length=args.max_length, device=args.device,
        dtype=torch_dtype(args.dtype, args.device),
    )  # fmt: skip
    for task in tasks:
        print(f"## {task}\n")
        print(format_table(result, task))
        print()
        if args.plot_dir is not None:
            plot = Path(args.plot_dir) / f"eval_{task}.png"
            plot_sweep(result, task, plot)
            print(f"plot written to {plot}", file=sys.stderr)
    print(f"{len(result.depths)} depth(s) in {result.seconds:.1f} s", file=sys.stderr)
    if args.output is not None:
        write_json(result, args.output)
    return 0
