"""`tinyloop <model> generate` for models with an embedded tokenizer: text in, text out, family exits."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tinyloop.cli.args import (
    CliError,
    Parser,
    loop_count,
    non_negative_int,
    probability,
    refuse_unused,
    report_grammar_cut,
    torch_dtype,
    utf8_text,
)

# runtime.adaptive_exit.CRITERIA, repeated so that parsing needs no torch.
CRITERIA = ("kl", "entropy", "argmax", "latent", "gate")


def add_text_arguments(p: Parser) -> None:
    g = p.add_argument_group("models with an embedded tokenizer (Ouro, Huginn)")
    g.add_argument("--chat", action="store_true", help="send --prompt as a user message through the chat template")
    g.add_argument("--system", default=None, help="with --chat: a system message first")
    g.add_argument("--exit-threshold", type=probability, help="Ouro: exit at the first loop with CDF >= q")
    g.add_argument("--exit-at-step", type=non_negative_int, help="Ouro: read the output of loop N (0-based)")
    g.add_argument("--weighted-exit", action="store_true", help="Ouro: mix every loop's logits by the exit pdf")
    g.add_argument("--exit-criterion", choices=CRITERIA, help="per-token adaptive depth in decoding (Huginn's)")
    g.add_argument("--exit-tol", type=float, default=None, help="threshold of --exit-criterion (default: Huginn's)")
    g.add_argument("--min-loops", type=loop_count, default=1, help="with --exit-criterion: loops before any exit")
    g.add_argument("--no-stop", action="store_true", help="do not stop at the family's end tokens")


def is_text_model(path: str) -> bool:
    """Token ids are not bytes: the model has (or should have) an embedded tokenizer."""
    from tinyloop.errors import TinyLoopFormatError
    from tinyloop.format.header import read_header

    try:
        header = read_header(path)
    except TinyLoopFormatError:
        return False  # the byte path reports the error
    return header.config.tokenizer == "embedded" or "tokenizer" in header.metadata


def _explicit(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def run_text_generate(path: str, args: argparse.Namespace, argv: list[str], grammar: Any = None) -> int:
    """Family exits (--exit-*) go through the family decoder; stop strings, a grammar and a depth warm-up
    through the runtime's generation loop (the two do not combine yet)."""
    if not args.prompt:
        raise CliError("--prompt must not be empty")
    utf8_text(args.prompt, "--prompt")
    if args.system is not None:
        utf8_text(args.system, "--system")
    if args.exit_criterion is None:
        refuse_unused(args, {"exit_tol": None, "min_loops": 1}, "these tune --exit-criterion, which is not given")
    if args.system is not None and not args.chat:
        raise CliError("--system is a chat message: it needs --chat")
    for text in args.stop or ():
        utf8_text(text, "--stop")
    runtime_features = bool(args.stop) or grammar is not None or args.l_warmup_tokens > 0
    exits = args.exit_threshold is not None or args.exit_at_step is not None or args.weighted_exit
    if runtime_features and (exits or args.exit_criterion):
        raise CliError("--stop, --regex, --json-schema and --l-warmup-tokens do not combine with the --exit-* options")
    from tinyloop.api.model import Model
    from tinyloop.errors import TinyLoopFormatError
    from tinyloop.format.header import read_header

    try:
        max_pos = read_header(path).config.max_position
        model = Model(path, max_seq_len=max_pos, device=args.device, dtype=torch_dtype(args.dtype, args.device),
                      cache_window=args.cache_window)  # fmt: skip
    except TinyLoopFormatError as exc:
        raise CliError(str(exc), code=1) from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    with model:
        if not model.has_tokenizer:
            raise CliError("this model has no embedded tokenizer; re-convert it from a folder with tokenizer.json")
        loops = args.loops if _explicit(argv, "--loops") else model.header.config.default_loops
        prompt: str | list[dict[str, str]] = args.prompt
        if args.chat:
            prompt = [{"role": "user", "content": args.prompt}]
            if args.system:
                prompt.insert(0, {"role": "system", "content": args.system})
        out = sys.stdout
        if not args.chat:
            out.write(args.prompt)
            out.flush()
        if runtime_features:
            return _runtime_generate(model, prompt, loops, args, grammar)
        try:
            stream = model.generate_text_stream(
                prompt, args.max_tokens, loops, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, exit_threshold=args.exit_threshold, exit_at_step=args.exit_at_step,
                weighted_exit=args.weighted_exit, exit_criterion=args.exit_criterion, exit_tol=args.exit_tol,
                min_loops=args.min_loops, stop=not args.no_stop,
            )  # fmt: skip
            for piece in stream:
                out.write(piece)
                out.flush()
        except ValueError as exc:
            raise CliError(str(exc)) from None
        out.write("\n")
        out.flush()
        s = model.last_family_stats
        assert s is not None
        depth = sum(s.exit_depths) / len(s.exit_depths) if s.exit_depths else float(loops)
        print(
            f"prefill: {s.prefill_s * 1e3:.1f} ms ({s.prompt_tokens} tokens), "
            f"decode: {s.decode_tokens_per_s:.1f} tokens/s ({s.generated_tokens} tokens, loops {loops}, "
            f"mean depth {depth:.2f})",
            file=sys.stderr,
        )
    return 0


def _runtime_generate(model: Any, prompt: str | list[dict[str, str]], loops: int, args: Any, grammar: Any) -> int:
    """Text out of `Model.generate_stream`: stop strings, a grammar over the BPE vocabulary, a depth warm-up,
    and the embedded tokenizer's end tokens (unless --no-stop)."""
    tok = model.tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else tok.chat_prompt(prompt, add_generation_prompt=True)
    if ids.size == 0:
        raise CliError("the prompt encodes to no tokens")
    try:
        stream = model.generate_stream(
            ids, args.max_tokens, loops, args.temperature, args.top_k, args.top_p, args.seed,
            stop_tokens=None if args.no_stop else list(tok.stop_ids), stop=args.stop, grammar=grammar,
            l_warmup_tokens=args.l_warmup_tokens, l_warmup_loops=args.l_warmup_L, text=True,
        )  # fmt: skip
        for piece in stream:
            sys.stdout.write(piece.text)
            sys.stdout.flush()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = model.last_stats
    print(
        f"prefill: {s.prefill_s * 1e3:.1f} ms ({s.prompt_tokens} tokens), "
        f"decode: {s.decode_tokens_per_s:.1f} tokens/s ({s.generated_tokens} tokens, loops {loops}, "
        f"stop: {s.stop_reason})",
        file=sys.stderr,
    )
    report_grammar_cut("tinyloop generate", s.finished, args.max_tokens)
    return 0
