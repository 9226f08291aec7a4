"""`tinyloop <model> speculate`: self-speculative decoding (draft with few loops, verify with many)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from tinyloop.cli.args import (
    CliError,
    Parser,
    add_device_arguments,
    add_warmup_arguments,
    argv_bytes,
    check_sampling,
    check_warmup_and_stop,
    loop_count,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    refuse_unused,
    report_grammar_cut,
    torch_dtype,
    utf8_text,
)
from tinyloop.cli.constraint_args import add_constraint_arguments, build_grammar

if TYPE_CHECKING:
    from tinyloop.api.model import Model
    from tinyloop.runtime.speculative import SpeculativeStats


def build_parser() -> Parser:
    p = Parser(prog="tinyloop speculate", description="Self-speculative decoding with one model's weights.")
    p.add_argument("--prompt", default="The meaning of life is", help="prompt text (default: %(default)r)")
    p.add_argument("--draft-loops", type=loop_count, default=2, help="loops of a draft step (default: 2)")
    p.add_argument("--verify-loops", type=loop_count, default=8, help="loops of verification (default: 8)")
    p.add_argument("--draft-ahead", type=positive_int, default=4, help="tokens drafted per round (default: 4)")
    p.add_argument("--max-tokens", type=non_negative_int, default=50, help="new tokens (default: 50)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy (default: 0.0)")
    p.add_argument("--top-k", type=non_negative_int, default=50, help="0 disables (default: 50)")
    p.add_argument("--top-p", type=probability, default=0.9, help="nucleus mass in (0, 1] (default: 0.9)")
    p.add_argument(
        "--cache-window", type=non_negative_int, default=0,
        help="sliding KV window; only 0 (full cache): rejected drafts must be rolled back",
    )  # fmt: skip
    p.add_argument("--seed", type=non_negative_int, default=None, help="makes sampling repeatable")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="end before this text (repeatable)")
    p.add_argument("--no-stop", action="store_true", help="do not stop at an embedded tokenizer's end tokens")
    add_warmup_arguments(p)
    p.add_argument("--stats", action="store_true", help="acceptance, tokens per verify pass and speed-up to stderr")
    p.add_argument("--no-adaptive", action="store_true", help="always draft --draft-ahead tokens")
    add_device_arguments(p)  # the same --dtype default as generate, so that greedy output equals generate's
    add_constraint_arguments(p)
    return p


def run_speculate(path: str, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.draft_loops >= args.verify_loops:
        raise CliError(f"--draft-loops ({args.draft_loops}) must be smaller than --verify-loops ({args.verify_loops})")
    if not args.prompt:
        raise CliError("--prompt must not be empty")
    if args.cache_window:
        raise CliError(
            f"--cache-window {args.cache_window} cannot be used with speculate: rejected drafts are rolled back, "
            "which a sliding window cannot do; use --cache-window 0"
        )
    check_warmup_and_stop(args, args.verify_loops, "--verify-loops")
    grammar = build_grammar(args)
    check_sampling(args, args.verify_loops)
    from tinyloop.format.header import read_header

    cfg = read_header(path).config
    byte_model = cfg.tokenizer == "bytes"
    if byte_model:
        refuse_unused(args, {"no_stop": False}, "a byte-level model has no end tokens to ignore")
        prompt_bytes = argv_bytes(args.prompt)
        stop = None if args.stop is None else [argv_bytes(text) for text in args.stop]
        if len(prompt_bytes) + args.max_tokens > cfg.max_position:
            raise CliError(
                f"--prompt ({len(prompt_bytes)} bytes) + --max-tokens {args.max_tokens} exceeds the model's "
                f"maximum position {cfg.max_position}"
            )
    else:
        prompt_bytes = utf8_text(args.prompt, "--prompt").encode("utf-8")
        stop = None if args.stop is None else [utf8_text(text, "--stop").encode("utf-8") for text in args.stop]

    from tinyloop.api.model import Model

    # A text prompt has at most one token per byte, plus a bos.
    room = min(len(prompt_bytes) + 1 + args.max_tokens, cfg.max_position)
    model = Model(
        path, max_seq_len=room, device=args.device, dtype=torch_dtype(args.dtype, args.device),
        cache_window=args.cache_window,
    )  # fmt: skip
    with model:
        prompt = list(prompt_bytes) if byte_model else model.encode(args.prompt)
        model.max_seq_len = min(len(prompt) + args.max_tokens, cfg.max_position)
        # As generate: a model with an embedded tokenizer stops at its end tokens (which are not printed).
        stop_tokens = None if byte_model or args.no_stop or not model.has_tokenizer else model.tokenizer.stop_ids
        kwargs: dict[str, Any] = dict(
            grammar=grammar, stop_tokens=stop_tokens, stop=stop, l_warmup_tokens=args.l_warmup_tokens,
            l_warmup_loops=args.l_warmup_L,
        )  # fmt: skip
        out = sys.stdout.buffer
        try:
            stream = model.generate_speculative_stream(
                prompt, args.max_tokens, args.draft_loops, args.verify_loops, args.draft_ahead,
                args.temperature, args.top_k, args.top_p, args.seed, not args.no_adaptive, text=not byte_model,
                **kwargs,
            )  # fmt: skip
        except ValueError as exc:
            raise CliError(" ".join(str(exc).split())) from None
        out.write(prompt_bytes)
        out.flush()
        tokens: list[int] = []
        for item in stream:
            if byte_model:
                tokens.append(item)
                out.write(bytes((item,)) if item < 256 else b"")
            else:
                tokens.append(item.token)
                out.write(item.text.encode("utf-8"))
            out.flush()
        out.write(b"\n")
        out.flush()
        s = model.last_speculative_stats
        print(
            f"prefill: {s.prefill_s * 1e3:.1f} ms ({s.prompt_tokens} tokens), decode: {s.decode_tokens_per_s:.1f} "
            f"tokens/s ({s.generated_tokens} tokens, draft {args.draft_loops} / verify {args.verify_loops} loops)",
            file=sys.stderr,
        )
        report_grammar_cut("tinyloop speculate", s.finished, args.max_tokens)
        if args.stats:
            _print_stats(model, prompt, args, s, tokens, kwargs)
    return 0


def _print_stats(
    model: Model, prompt: Any, args: argparse.Namespace, s: SpeculativeStats, tokens: list[int], kwargs: dict[str, Any]
) -> None:
    """Acceptance figures, then a plain run at --verify-loops with the same arguments for the speed-up."""
    a = args
    t0 = time.perf_counter()
    plain = model.generate(prompt, a.max_tokens, a.verify_loops, a.temperature, a.top_k, a.top_p, a.seed, **kwargs)
    plain_s = time.perf_counter() - t0
    speedup = plain_s / s.time_s if s.time_s > 0 else 0.0
    same = "same tokens" if plain.tolist() == tokens else "different tokens"
    print(
        f"speculate: acceptance {s.acceptance_rate:.1%} ({s.accepted}/{s.drafted} drafted), "
        f"{s.tokens_per_verify:.2f} tokens per verify pass ({s.verify_passes} passes), "
        f"{s.plain_steps} plain steps, {s.warmup_steps} warm-up steps, stop {s.stop_reason}, finished {s.finished}"
        + ("" if s.prompt_agreement is None else f", draft/verify agreement on the prompt {s.prompt_agreement:.0%}"),
        file=sys.stderr,
    )
    print(
        f"speed-up: {speedup:.2f}x ({s.time_s * 1e3:.0f} ms vs plain {plain_s * 1e3:.0f} ms at "
        f"{a.verify_loops} loops; {same})",
        file=sys.stderr,
    )
