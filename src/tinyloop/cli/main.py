"""`tinyloop <model> <command> [options]`: resolves the model and hands off to one verb module."""

from __future__ import annotations

import gc
import sys
from importlib import import_module

from tinyloop.cli.args import CliError

# verb -> (module, function). Modules import lazily: `inspect` must start without torch.
VERBS: dict[str, tuple[str, str]] = {
    "inspect": ("tinyloop.cli.inspect_cmd", "run_inspect"),
    "verify": ("tinyloop.cli.verify_cmd", "run_verify"),
    "generate": ("tinyloop.cli.generate_cmd", "run_generate"),
    "lens": ("tinyloop.cli.lens_cmd", "run_lens"),
    "speculate": ("tinyloop.cli.speculate_cmd", "run_speculate"),
    "benchmark": ("tinyloop.cli.benchmark_cmd", "run_benchmark"),
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
run `tinyloop <model> <command> --help` for a command's options."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "--version":
        from tinyloop import __version__

        print(f"tinyloop {__version__}")
        return 0
    if len(args) < 2:
        print("tinyloop: error: missing command after the model (try: inspect, generate)", file=sys.stderr)
        return 2
    model, verb, rest = args[0], args[1], args[2:]
    if verb not in VERBS:
        if verb in LATER:
            print(f"tinyloop: error: the '{verb}' command is not available in this version yet", file=sys.stderr)
        else:
            print(f"tinyloop: error: unknown command {verb!r}; choose one of {sorted(VERBS)}", file=sys.stderr)
        return 2
    try:
        from tinyloop.builtin import resolve_model

        path = resolve_model(model)
    except ValueError as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return 2
    module, func = VERBS[verb]
    try:
        result: int = getattr(import_module(module), func)(str(path), rest)
        return result
    except CliError as exc:
        print(f"tinyloop {verb}: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    finally:
        # The command is done: spare the exit's garbage collection a pass over torch's ~165k objects (~0.9 s).
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
