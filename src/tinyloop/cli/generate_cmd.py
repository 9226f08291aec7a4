"""`tinyloop <model> generate`: stream a continuation of a prompt to stdout, timing to stderr."""

from __future__ import annotations

import sys

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
    probability,
    refuse_unused,
    report_grammar_cut,
    torch_dtype,
)
from tinyloop.cli.constraint_args import add_constraint_arguments, build_grammar
from tinyloop.cli.text_generate import add_text_arguments, is_text_model, run_text_generate


def build_parser() -> Parser:
    p = Parser(prog="tinyloop generate", description="Generate a continuation of a prompt.")
    p.add_argument("--prompt", default="The meaning of life is", help="prompt text (default: %(default)r)")
    p.add_argument("--loops", type=loop_count, default=8, help="loop iterations per token (default: 8)")
    p.add_argument("--max-tokens", type=non_negative_int, default=128, help="new tokens (default: 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=non_negative_int, default=50, help="0 disables (default: 50)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=non_negative_int, default=None, help="makes sampling repeatable")
    p.add_argument("--cache-window", type=non_negative_int, default=0, help="sliding KV window, 0 = full cache")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="end before this text (repeatable)")
    add_warmup_arguments(p)
    add_device_arguments(p)
    add_constraint_arguments(p)
    add_text_arguments(p)
    return p


# Options of models with an embedded tokenizer (cli/text_generate.py), as they are when not given.
TEXT_ONLY = {
    "chat": False, "system": None, "exit_threshold": None, "exit_at_step": None, "weighted_exit": False,
    "exit_criterion": None, "exit_tol": None, "min_loops": 1, "no_stop": False,
}  # fmt: skip


def run_generate(path: str, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_warmup_and_stop(args, args.loops, "--loops")
    grammar = build_grammar(args)
    check_sampling(args, args.loops)
    if is_text_model(path):  # an embedded tokenizer: text prompts, family exits (cli/text_generate.py)
        return run_text_generate(path, args, argv, grammar)
    refuse_unused(args, TEXT_ONLY, "only for models with an embedded tokenizer; this is a byte-level model")
    prompt = argv_bytes(args.prompt)
    if not prompt:
        raise CliError("--prompt must not be empty")
    from tinyloop.format.header import read_header

    max_position = read_header(path).config.max_position
    if len(prompt) + args.max_tokens > max_position:
        raise CliError(
            f"--prompt ({len(prompt)} bytes) + --max-tokens {args.max_tokens} exceeds the model's maximum "
            f"position {max_position}"
        )

    from tinyloop.api.model import Model

    model = Model(
        path,
        max_seq_len=len(prompt) + args.max_tokens,
        device=args.device,
        dtype=torch_dtype(args.dtype, args.device),
        cache_window=args.cache_window,
    )
    with model:
        if model.header.config.tokenizer != "bytes" or model.header.config.vocab_size < 256:
            raise CliError("this model has no byte vocabulary; text prompts need an embedded tokenizer")
        stop = None if args.stop is None else [argv_bytes(text) for text in args.stop]
        stream = model.generate_stream(
            list(prompt), args.max_tokens, args.loops, args.temperature, args.top_k, args.top_p, args.seed,
            grammar=grammar, stop=stop, l_warmup_tokens=args.l_warmup_tokens, l_warmup_loops=args.l_warmup_L,
        )  # fmt: skip
        out = sys.stdout.buffer
        out.write(prompt)
        out.flush()
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
        report_grammar_cut("tinyloop generate", s.finished, args.max_tokens)
    return 0
