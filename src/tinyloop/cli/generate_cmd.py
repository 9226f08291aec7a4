"""`tinyloop <model> generate`: stream a continuation of a prompt to stdout, timing to stderr."""

from __future__ import annotations

import sys

from tinyloop.cli.args import (
    CliError,
    Parser,
    add_dtype_argument,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    torch_dtype,
)
from tinyloop.cli.constraint_args import add_constraint_arguments, build_grammar
from tinyloop.cli.text_generate import add_text_arguments, is_text_model, run_text_generate


def build_parser() -> Parser:
    p = Parser(prog="tinyloop generate", description="Generate a continuation of a prompt.")
    p.add_argument("--prompt", default="The meaning of life is", help="prompt text (default: %(default)r)")
    p.add_argument("--loops", type=positive_int, default=8, help="loop iterations per token (default: 8)")
    p.add_argument("--max-tokens", type=non_negative_int, default=128, help="new tokens (default: 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=non_negative_int, default=50, help="0 disables (default: 50)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=non_negative_int, default=None, help="makes sampling repeatable")
    p.add_argument("--cache-window", type=non_negative_int, default=0, help="sliding KV window, 0 = full cache")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="end before this text (repeatable)")
    p.add_argument("--l-warmup-tokens", type=non_negative_int, default=0, help="first N decode steps run shallower")
    p.add_argument("--l-warmup-L", type=positive_int, default=2, help="loops during the warm-up steps (default: 2)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    add_dtype_argument(p)
    add_constraint_arguments(p)
    add_text_arguments(p)
    return p


def run_generate(path: str, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.l_warmup_tokens and args.l_warmup_L > args.loops:
        raise CliError(f"--l-warmup-L ({args.l_warmup_L}) must not exceed --loops ({args.loops})")
    if args.stop is not None and not all(args.stop):
        raise CliError("--stop must not be empty")
    grammar = build_grammar(args)
    if is_text_model(path):  # an embedded tokenizer: text prompts, family exits (cli/text_generate.py)
        return run_text_generate(path, args, argv, grammar)
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        raise CliError("--prompt must not be empty")

    from tinyloop.api.model import Model
    from tinyloop.errors import TinyLoopFormatError

    try:
        model = Model(
            path,
            max_seq_len=len(prompt) + args.max_tokens,
            device=args.device,
            dtype=torch_dtype(args.dtype, args.device),
            cache_window=args.cache_window,
        )
    except TinyLoopFormatError as exc:
        raise CliError(str(exc), code=1) from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    with model:
        if model.header.config.tokenizer != "bytes" or model.header.config.vocab_size < 256:
            raise CliError("this model has no byte vocabulary; text prompts need an embedded tokenizer")
        out = sys.stdout.buffer
        out.write(prompt)
        out.flush()
        stream = model.generate_stream(
            list(prompt), args.max_tokens, args.loops, args.temperature, args.top_k, args.top_p, args.seed,
            grammar=grammar, stop=args.stop, l_warmup_tokens=args.l_warmup_tokens, l_warmup_loops=args.l_warmup_L,
        )  # fmt: skip
        for token in stream:
            out.write(bytes((token,)) if token < 256 else b"")
            out.flush()
        out.write(b"\n")
        out.flush()
        s = model.last_stats
        print(
            f"prefill: {s.prefill_s * 1e3:.1f} ms ({s.prompt_tokens} tokens), "
            f"decode: {s.decode_tokens_per_s:.1f} tokens/s ({s.generated_tokens} tokens, loops {args.loops})",
            file=sys.stderr,
        )
    return 0
