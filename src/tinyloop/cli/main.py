"""`tinyloop <model> <command> [options]`: resolves the model and hands off to one verb module."""

from __future__ import annotations

import gc
import sys
from importlib import import_module

from tinyloop.cli.args import CliError
from tinyloop.cli.guard import run_guarded

# verb -> (module, function). Modules import lazily: `inspect` must start without torch.
VERBS: dict[str, tuple[str, str]] = {
    "inspect": ("tinyloop.cli.inspect_cmd", "run_inspect"),
    "verify": ("tinyloop.cli.verify_cmd", "run_verify"),
    "generate": ("tinyloop.cli.generate_cmd", "run_generate"),
    "lens": ("tinyloop.cli.lens_cmd", "run_lens"),
    "speculate": ("tinyloop.cli.speculate_cmd", "run_speculate"),
    "benchmark": ("tinyloop.cli.benchmark_cmd", "run_benchmark"),
    "serve": ("tinyloop.cli.serve_cmd", "run_serve"),
    "eval": ("tinyloop.cli.eval_cmd", "run_eval"),
    "batch": ("tinyloop.cli.batch_cmd", "run_batch"),
}
LATER: set[str] = set()

USAGE = """usage: tinyloop <model> <command> [options]

<model> is a .tinyloop file or the name of a built-in model (e.g. tiny).
commands:
  inspect    header, dimensions, memory and KV estimates (reads no tensor data)
  verify     check every tensor's checksum
  generate   generate a continuation of --prompt
  speculate  self-speculative decoding: draft with --draft-loops, verify with --verify-loops
  lens       the top prediction after each loop at every position (--plot FILE.png for a heatmap)
  benchmark  latency and tokens/s of forward scoring (--decode N: cached generation) on synthetic tokens
  serve      an OpenAI-compatible HTTP server (needs the 'serve' extra: pip install 'loopformer[serve]')
  batch      a task (generate, score, lens, uncertainty) over every row of a JSONL or Parquet file into
             Parquet shards, resumable (--resume); --ray runs it over a Ray cluster (needs the 'ray' extra)
  eval       lm-evaluation-harness tasks from local files at one depth or a sweep (--loops 1,2,4,8; needs the
             'eval' extra); `tinyloop eval <model> ...` is read the same way
run `tinyloop <model> <command> --help` for a command's options."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 and args[0] == "eval" and args[1] not in VERBS and not args[1].startswith("-"):
        args[0], args[1] = args[1], args[0]  # lm-eval's habit `tinyloop eval MODEL ...`: the same command
    verb = args[1] if len(args) > 1 and args[1] in VERBS else None
    try:
        return run_guarded(f"tinyloop {verb}" if verb else "tinyloop", lambda: _dispatch(args))
    finally:
        if argv is None:  # the process ends next (not a call from Python code)
            # Spare the exit's garbage collection a pass over torch's ~165k objects (~0.9 s).
            gc.freeze()


def _dispatch(args: list[str]) -> int:
    if not args:
        raise CliError("missing the model and the command; usage: tinyloop <model> <command> [options] (see --help)")
    if args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] == "--version":
        from tinyloop import __version__

        print(f"tinyloop {__version__}")
        return 0
    if args[0] in VERBS and (len(args) < 2 or args[1] not in VERBS):
        model = args[1] if len(args) > 1 and not args[1].startswith("-") else "<model>"
        raise CliError(f"the model comes first, then the command: tinyloop {model} {args[0]} [options]")
    if len(args) < 2:
        raise CliError("missing command after the model (try: inspect, generate)")
    model, verb, rest = args[0], args[1], args[2:]
    if verb not in VERBS:
        if verb in LATER:
            raise CliError(f"the '{verb}' command is not available in this version yet")
        raise CliError(f"unknown command {verb!r}; choose one of {sorted(VERBS)}")
    from tinyloop.builtin import resolve_model

    path = resolve_model(model)  # ValueError: neither a file nor a built-in name (exit 2)
    module, func = VERBS[verb]
    result: int = getattr(import_module(module), func)(str(path), rest)
    return result


if __name__ == "__main__":
    sys.exit(main())
