"""Argument parsing shared by the CLI verbs: one-line errors with exit status 2."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, NoReturn

from tinyloop.config import MAX_LOOPS

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


class CliError(Exception):
    """A user error: printed as one line, exit status `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype", choices=DTYPE_NAMES, default="auto",
        help="compute dtype (default: auto = on the CPU bfloat16 where it has native bfloat16 instructions "
        "(AVX-512 BF16 or AMX), else float32; on CUDA float32 for models up to d=1024, else bfloat16); on the CPU, "
        "bfloat16 runs the INT4 matmuls through torch's INT4 kernel, the rest in float32",
    )  # fmt: skip


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """--device, then --dtype."""
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    add_dtype_argument(p)


def add_warmup_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--l-warmup-tokens", type=non_negative_int, default=0, help="first N decode steps run shallower")
    p.add_argument("--l-warmup-L", type=loop_count, default=2, help="loops during the warm-up steps (default: 2)")


def parse_or_exit_code(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Parsed arguments, or the exit code after --help (0) or a usage error (2, already printed on one line)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2


def torch_dtype(name: str, device: str | None = None) -> torch.dtype | None:
    """The --dtype choice as a torch dtype for --device (None: the runtime's default)."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0] == "cpu"
    return torch.bfloat16 if on_cpu and auto_cpu_bfloat16(cpu_flags()) else None


# x86 flags of native bfloat16 arithmetic; torch's CPU INT4 kernel is vectorised for bfloat16 inputs only.
NATIVE_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def auto_cpu_bfloat16(flags: frozenset[str]) -> bool:
    """Whether --dtype auto takes bfloat16 matmuls on a CPU with these feature flags: only with native bfloat16.

    The built-in model on a 2-core AMD EPYC with AVX-512 BF16 decoded 2.2x and prefilled 1.4x faster in bfloat16
    than in float32 (docs/BENCHMARKS.md); an AVX2-only 2-core machine decoded no faster and prefilled 3x slower.
    """
    return bool(flags & NATIVE_BFLOAT16_FLAGS)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def loop_count(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= MAX_LOOPS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_LOOPS}], got {text!r}")
    return value


def loops_list(text: str) -> list[int]:
    """Comma-separated distinct loop counts, e.g. 1,2,4,8 (sorted)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"must be distinct positive integers, got {text!r}")
    return sorted(values)


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    value = _float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def argv_bytes(text: str) -> bytes:
    """An argument's bytes as the shell passed them (Python decodes argv with surrogate escapes, so bytes
    that are not UTF-8, such as $'\\xff', come back unchanged): a byte-level model's tokens."""
    return os.fsencode(text)


def utf8_text(text: str, flag: str) -> str:
    """An argument that must be text (for a tokenizer): refused when its bytes are not valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CliError(f"{flag} is not valid UTF-8 text; this model's tokenizer reads text") from None
    return text


def refuse_unused(args: argparse.Namespace, defaults: Mapping[str, object], why: str) -> None:
    """Usage error for options given but meaningless here: `defaults` maps dest -> value when not given."""
    given = [f"--{dest.replace('_', '-')}" for dest, default in defaults.items() if getattr(args, dest) != default]
    if given:
        raise CliError(f"{', '.join(given)}: {why}")


def check_warmup_and_stop(args: argparse.Namespace, loops: int, loops_flag: str) -> None:
    """--l-warmup-L only with --l-warmup-tokens and at most `loops` (given as `loops_flag`); no empty --stop."""
    if not args.l_warmup_tokens:
        refuse_unused(args, {"l_warmup_L": 2}, "the warm-up depth needs --l-warmup-tokens N (N > 0)")
    if args.l_warmup_tokens and args.l_warmup_L > loops:
        raise CliError(f"--l-warmup-L ({args.l_warmup_L}) must not exceed {loops_flag} ({loops})")
    if args.stop is not None and not all(args.stop):
        raise CliError("--stop must not be empty")


def report_grammar_cut(prog: str, finished: bool, max_tokens: int) -> None:
    """Warn when --max-tokens ended the output before the grammar could accept it."""
    if not finished:
        print(
            f"{prog}: warning: --max-tokens {max_tokens} ended the output before it matched the grammar "
            "(--regex / --json-schema); the text is only a prefix of a match",
            file=sys.stderr,
        )


def check_sampling(args: argparse.Namespace, loops: int) -> None:
    """Build the request's SamplingParams before the model loads, so that a value the runtime refuses
    (a subnormal --temperature, a --seed of 2**64 or more) fails before any output."""
    from tinyloop.sampling import SamplingParams

    SamplingParams(
        max_tokens=args.max_tokens, loops=loops, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, l_warmup_tokens=args.l_warmup_tokens, l_warmup_loops=args.l_warmup_L,
    )  # fmt: skip
