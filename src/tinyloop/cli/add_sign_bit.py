"""`tinyloop-add-sign-bit`: add cross-iteration rounding channels to a `.tinyloop` file's looped INT4 weights."""

from __future__ import annotations

import argparse
import os
import sys

from tinyloop.cli.args import Parser
from tinyloop.cli.guard import one_line, run_main

PROG = "tinyloop-add-sign-bit"


def build_parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description="Store each looped INT4 weight's rounding error (1-bit sign or 4-bit fraction), computed "
        "from the original float checkpoint, for TINYLOOP_CROSS_ITER_ROUND=1. Writes a format 2.0 file.",
    )
    parser.add_argument(
        "--from-pt",
        required=True,
        metavar="CHECKPOINT",
        help="the float weights the file was quantized from: torch .pt state dict, .safetensors, or sharded "
        "training output (a shard, its index JSON or their directory)",
    )
    parser.add_argument(
        "--loop-only",
        action="store_true",
        help="channels on the looped matrices only (body and adapter); required, the only mode",
    )
    parser.add_argument(
        "--frac-bits", type=int, choices=(1, 4), default=1, help="1: sign of the error (default); 4: its fraction"
    )
    parser.add_argument("-i", "--input", required=True, help="the INT4 .tinyloop file")
    parser.add_argument("-o", "--output", required=True, help="the .tinyloop file to write (atomically)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, build_parser, _run, argv)


def _run(args: argparse.Namespace) -> int:
    if not args.loop_only:
        # Outside the loop a matrix is applied once per token, so a random rounding adds noise that no
        # later iteration averages out.
        print(f"{PROG}: error: pass --loop-only: channels are only defined for looped matrices", file=sys.stderr)
        return 2
    from tinyloop.convert.add_channels import add_rounding_channels

    try:
        report = add_rounding_channels(args.input, args.output, args.from_pt, args.frac_bits, not args.quiet)
    except (ValueError, OSError) as exc:
        print(f"{PROG}: error: {one_line(str(exc))}", file=sys.stderr)
        return 1
    size = os.path.getsize(args.output)
    print(
        f"wrote {args.output}: format {report.header.format_version_str}, {report.channel} channel on "
        f"{len(report.matrices)} looped matrices ({report.weights:,} weights, mean |error| "
        f"{report.mean_abs_residual:.3f} steps), {size:,} bytes"
    )
    return 0
