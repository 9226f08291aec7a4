"""`tinyloop <model> benchmark`: latency and throughput of forward scoring (and cached decoding) on
synthetic token ids. TINYLOOP_CUDA_PROFILE=1 skips the warm-up and prints the time of each segment."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from tinyloop.cli.args import (
    CliError,
    Parser,
    add_device_arguments,
    loop_count,
    non_negative_int,
    parse_or_exit_code,
    positive_int,
    torch_dtype,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from tinyloop.runtime.benchmark import BenchmarkConfig, BenchmarkResult


def build_parser() -> Parser:
    p = Parser(
        prog="tinyloop benchmark",
        description="Time repeated forward scoring of synthetic tokens (and, with --decode, cached generation).",
    )
    p.add_argument("--loops", type=loop_count, default=8, help="loop iterations (default: 8)")
    p.add_argument("--seq-len", type=positive_int, default=512, help="synthetic tokens per row (default: 512)")
    p.add_argument("--repeat", type=positive_int, default=20, help="timed forward runs (default: 20)")
    p.add_argument("--batch", type=positive_int, default=1, help="rows per forward and decode step (default: 1)")
    p.add_argument(
        "--decode", type=non_negative_int, default=0, metavar="N",
        help="also time a prefill of --seq-len tokens and N cached greedy decode steps (default: 0, off)",
    )  # fmt: skip
    p.add_argument("--decode-repeat", type=positive_int, default=3, help="timed decode runs (default: 3)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the synthetic tokens (default: 0)")
    add_device_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with every number")
    return p


def run_benchmark(path: str, argv: list[str]) -> int:
    args = parse_or_exit_code(build_parser(), argv)
    if isinstance(args, int):
        return args
    import torch

    from tinyloop.env import RuntimeEnv
    from tinyloop.errors import OutOfMemoryError, TinyLoopFormatError
    from tinyloop.format.header import read_header
    from tinyloop.runtime import benchmark as bm
    from tinyloop.runtime.loader import pick_device

    try:
        profile = RuntimeEnv.read().cuda_profile
    except ValueError as exc:
        raise CliError(str(exc)) from None
    bench = bm.BenchmarkConfig(
        loops=args.loops, seq_len=args.seq_len, repeat=args.repeat, batch=args.batch, decode=args.decode,
        decode_repeat=args.decode_repeat, seed=args.seed, profile=profile,
    )  # fmt: skip
    try:
        header = read_header(path)
    except TinyLoopFormatError as exc:
        raise CliError(str(exc), code=1) from None
    cfg = header.config
    if args.seq_len > cfg.max_position:
        raise CliError(f"--seq-len {args.seq_len} exceeds the model's maximum position {cfg.max_position}")
    if args.seq_len + args.decode > cfg.max_position:
        raise CliError(
            f"--seq-len {args.seq_len} + --decode {args.decode} exceeds the model's maximum position {cfg.max_position}"
        )
    try:
        pick_device(args.device)
    except ValueError as exc:
        raise CliError(f"--device: {exc}") from None
    try:
        result = benchmark_file(path, bench, args.device, torch_dtype(args.dtype, args.device))
    except TinyLoopFormatError as exc:
        raise CliError(str(exc), code=1) from None
    except (OutOfMemoryError, torch.OutOfMemoryError) as exc:
        raise CliError(str(exc), code=1) from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(json.dumps(result.to_dict(), indent=2) if args.json else render(result))
    return 0


def benchmark_file(
    path: str, bench: BenchmarkConfig, device: str | None = None, dtype: torch.dtype | None = None
) -> BenchmarkResult:
    """Load a `.tinyloop` file (or built-in name) as `Model` does and measure its engine.

    Raises ValueError for out-of-range settings (before the weights load), TinyLoopFormatError for a bad file.
    """
    from tinyloop.api.model import Model
    from tinyloop.builtin import resolve_model
    from tinyloop.format.header import read_header
    from tinyloop.runtime.benchmark import run_benchmark as measure

    bench.check(read_header(resolve_model(path)).config)
    with Model(path, max_seq_len=bench.seq_len + bench.decode + 1, device=device, dtype=dtype) as model:

        def generate_rows(prompts: torch.Tensor, max_tokens: int) -> Iterator[tuple[int, int]]:
            rows = list(prompts.cpu().numpy())
            return model.generate_batch_stream(rows, max_tokens, bench.loops, temperature=0.0)

        # Scoring is timed on the engine Model built (switches applied); decoding through the API.
        return measure(model._engine, model.header, bench, generate_rows)


def render(result: BenchmarkResult) -> str:
    """The human-readable report."""
    m, q, b = result.model, result.quantization, result.config
    quant = f"{q['bits']}-bit" + (f" g{q['group_size']}" if q["group_size"] else "")
    layers = m["layers"]
    f = result.forward
    lines = [
        f"model: {m['name']} ({m['file']}), {quant}, {m['parameters'] / 1e6:.1f}M parameters, d={m['d_model']}, "
        f"layers {layers['prelude']}+{layers['body']}xL+{layers['coda']}, vocab {m['vocab_size']}",
        f"device: {result.device} ({result.device_name}), torch {result.torch_version}, {result.threads} threads, "
        f"{m['compute_dtype']}" + (f", {m['matmul_dtype']} matmuls" if m["matmul_dtype"] != m["compute_dtype"] else ""),
        f"loops {b.loops}, seq-len {b.seq_len}, batch {b.batch}, repeat {b.repeat}, "
        f"warm-up {'1 run' if result.warmup else 'skipped (TINYLOOP_CUDA_PROFILE=1)'}",
        f"forward: median {f.median_ms:.2f} ms, min {f.min_ms:.2f} ms, max {f.max_ms:.2f} ms, "
        f"{result.forward_tokens_per_s:,.1f} tokens/s",
    ]
    if result.switches:
        lines.append("switches: " + ", ".join(f"{k}={v}" for k, v in result.switches.items()))
    if result.not_applied:
        lines.append(
            "not applied (scoring runs every loop without a KV cache; KV-cache switches apply to --decode): "
            + ", ".join(result.not_applied)
        )
    if result.segments:
        total = sum(s.median_ms for s in result.segments.values())
        lines.append(f"segments (median of {b.repeat} runs, device synchronised between segments):")
        for name, lat in result.segments.items():
            share = 100 * lat.median_ms / total if total else 0.0
            lines.append(f"  {name:<10} {lat.median_ms:10.3f} ms  {share:5.1f}%")
        lines.append(f"  {'total':<10} {total:10.3f} ms")
        work = result.work
        work_total = sum(work.values()) or 1.0
        parts = ", ".join(f"{k} {v:.3f} ms ({100 * v / work_total:.1f}%)" for k, v in work.items())
        lines.append(f"work (torch.profiler, one run): {parts}")
    d = result.decode
    if d is not None:
        lines.append(
            f"decode: prefill {d.prefill.median_ms:.2f} ms ({b.seq_len} tokens), {d.tokens} tokens "
            f"{d.decode.median_ms:.2f} ms, {d.ms_per_token:.3f} ms/token, {d.tokens_per_s:,.1f} tokens/s "
            f"(median of {d.decode.runs} runs)"
        )
    return "\n".join(lines)
