"""`tinyloop-convert`: write a `.tinyloop` file from a checkpoint or from random weights."""

from __future__ import annotations

import argparse
import sys

from tinyloop.cli.args import Parser
from tinyloop.cli.guard import run_main
from tinyloop.presets import PRESETS

PROG = "tinyloop-convert"


def build_parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description="Write a .tinyloop model file from a canonical-name checkpoint or random weights.",
    )
    parser.add_argument("checkpoint", nargs="?", help="a .pt/.pth/.bin (torch.save) or .safetensors checkpoint")
    parser.add_argument("--config", help="architecture config JSON (required with CHECKPOINT)")
    parser.add_argument("--random", action="store_true", help="write random weights for --preset")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="architecture preset for --random")
    parser.add_argument("--seed", type=int, default=0, help="seed for --random (default 0)")
    parser.add_argument(
        "--from-hf", metavar="DIR", help="a Hugging Face Ouro or Huginn folder (config.json, safetensors, tokenizer)"
    )
    parser.add_argument(
        "--state-start",
        choices=("random", "zeros"),
        default=None,
        help="with --from-hf: Huginn's initial loop state (default: random, as its reference)",
    )
    parser.add_argument("-o", "--output", required=True, help="the .tinyloop file to write")
    parser.add_argument("--bits", type=int, choices=(4, 8, 16), default=16, help="weight bits (default 16)")
    parser.add_argument(
        "--group-size", type=int, choices=(32, 64, 128), default=64, help="INT4 group size (default 64)"
    )
    parser.add_argument(
        "--float-dtype",
        choices=("f16", "bf16", "f32", "auto"),
        default=None,
        help="dense dtype (default f16; with --from-hf: auto = the checkpoint's own precision)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, build_parser, _run, argv)


def _run(args: argparse.Namespace) -> int:
    if args.from_hf is not None:
        if args.checkpoint is not None or args.random or args.config is not None or args.preset is not None:
            return _fail("--from-hf DIR takes no CHECKPOINT, --config, --random or --preset")
        from tinyloop.convert.from_hf import convert_hf

        try:
            header = convert_hf(
                args.from_hf, args.output, args.bits, args.group_size if args.bits == 4 else None,
                args.float_dtype, not args.quiet, args.state_start,
            )  # fmt: skip
        except (ValueError, OSError) as exc:
            return _fail(str(exc))
        print(f"wrote {header.path}: {header.weight_bytes} weight bytes, {len(header.tensors)} stored tensors")
        return 0
    if args.state_start is not None:
        return _fail("--state-start applies to --from-hf only")
    if args.float_dtype in (None, "auto"):
        args.float_dtype = "f16"
    if args.random == (args.checkpoint is not None):
        return _fail("give either CHECKPOINT (with --config) or --random (with --preset)")
    if args.random and (args.preset is None or args.config is not None):
        return _fail("--random needs --preset NAME and takes no --config")
    if not args.random and (args.config is None or args.preset is not None):
        return _fail("CHECKPOINT needs --config CONFIG.json and takes no --preset")

    # Torch loads only here, after the arguments are known to be good.
    from tinyloop.convert.from_checkpoint import convert_checkpoint
    from tinyloop.convert.random_model import write_random_model
    from tinyloop.presets import preset

    group_size = args.group_size if args.bits == 4 else None
    try:
        if args.random:
            header = write_random_model(
                args.output, preset(args.preset), args.seed, args.bits, group_size, args.float_dtype, not args.quiet
            )
        else:
            header = convert_checkpoint(
                args.checkpoint, args.config, args.output, args.bits, group_size, args.float_dtype, not args.quiet
            )
    except (ValueError, OSError) as exc:  # TinyLoopFormatError and ConfigError are ValueErrors
        return _fail(str(exc))
    print(f"wrote {header.path}: {header.weight_bytes} weight bytes, {len(header.tensors)} stored tensors")
    return 0


def _fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
