"""`tinyloop FILE verify`: check the header and every tensor's CRC32 (never imports torch)."""

from __future__ import annotations

import sys

from tinyloop.cli.args import Parser, parse_or_exit_code
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.checksums import corrupted_tensors
from tinyloop.format.header import read_header


def run_verify(path: str, argv: list[str]) -> int:
    parser = Parser(prog="tinyloop verify", description="Check a .tinyloop file's header and checksums.")
    args = parse_or_exit_code(parser, argv)
    if isinstance(args, int):
        return args
    try:
        header = read_header(path)
        bad = corrupted_tensors(header)
    except TinyLoopFormatError as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return 1
    if not bad:
        print(f"OK: {len(header.tensors)} tensors, {header.weight_bytes} bytes, all checksums match")
        return 0
    print(f"CORRUPTED: {len(bad)} of {len(header.tensors)} tensors fail their CRC32 checksum:")
    for name in bad:
        print(f"  {name}")
    return 1
