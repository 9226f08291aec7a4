"""`tinyloop <model> speculate`: self-speculative decoding (draft with few loops, verify with many)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from tinyloop.cli.args import CliError, Parser, non_negative_float, non_negative_int, positive_int, probability
from tinyloop.cli.constraint_args import add_constraint_arguments, build_grammar

if TYPE_CHECKING:
    from tinyloop.api.model import Model
    from tinyloop.api.speculative import SpeculativeResult


def build_parser() -> Parser:
    p = Parser(prog="tinyloop speculate", description="Self-speculative decoding with one model's weights.")
    p.add_argument("--prompt", default="The meaning of life is", help="prompt text (default: %(default)r)")
    p.add_argument("--draft-loops", type=positive_int, default=2, help="loops of a draft step (default: 2)")
    p.add_argument("--verify-loops", type=positive_int, default=8, help="loops of verification (default: 8)")
    p.add_argument("--draft-ahead", type=positive_int, default=4, help="tokens drafted per round (default: 4)")
    p.add_argument("--max-tokens", type=non_negative_int, default=50, help="new tokens (default: 50)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy (default: 0.0)")
    p.add_argument("--top-k", type=non_negative_int, default=50, help="0 disables (default: 50)")
    p.add_argument("--top-p", type=probability, default=0.9, help="nucleus mass in (0, 1] (default: 0.9)")
    p.add_argument("--cache-window", type=non_negative_int, default=0, help="sliding KV window, 0 = full cache")
    p.add_argument("--seed", type=non_negative_int, default=None, help="makes sampling repeatable")
    p.add_argument("--stats", action="store_true", help="acceptance, tokens per verify pass and speed-up to stderr")
    p.add_argument("--no-adaptive", action="store_true", help="always draft --draft-ahead tokens")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    add_constraint_arguments(p)
    return p


def run_speculate(path: str, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.draft_loops >= args.verify_loops:
        raise CliError(f"--draft-loops ({args.draft_loops}) must be smaller than --verify-loops ({args.verify_loops})")
    if not args.prompt:
        raise CliError("--prompt must not be empty")
    grammar = build_grammar(args)

    from tinyloop.api.model import Model
    from tinyloop.errors import TinyLoopFormatError

    try:
        model = Model(path, max_seq_len=2048, device=args.device, cache_window=args.cache_window)
    except TinyLoopFormatError as exc:
        raise CliError(str(exc), code=1) from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    with model:
        byte_model = model.header.config.tokenizer == "bytes"
        prompt = list(args.prompt.encode("utf-8")) if byte_model else model.encode(args.prompt)
        model.max_seq_len = min(len(prompt) + args.max_tokens, model.header.config.max_position)
        try:
            res = model.generate_speculative(
                prompt, args.max_tokens, args.draft_loops, args.verify_loops, args.draft_ahead,
                args.temperature, args.top_k, args.top_p, args.seed, not args.no_adaptive, grammar=grammar,
            )  # fmt: skip
        except ValueError as exc:
            raise CliError(" ".join(str(exc).split())) from None
        out = sys.stdout.buffer
        if byte_model:
            out.write(args.prompt.encode("utf-8") + bytes(t for t in res.tokens.tolist() if t < 256))
        else:
            out.write((args.prompt + model.decode(res.tokens)).encode("utf-8"))
        out.write(b"\n")
        out.flush()
        s = res.stats
        print(
            f"prefill: {s.prefill_s * 1e3:.1f} ms ({s.prompt_tokens} tokens), decode: {s.decode_tokens_per_s:.1f} "
            f"tokens/s ({s.generated_tokens} tokens, draft {args.draft_loops} / verify {args.verify_loops} loops)",
            file=sys.stderr,
        )
        if args.stats:
            _print_stats(model, prompt, args, res)
    return 0


def _print_stats(model: Model, prompt: Any, args: argparse.Namespace, res: SpeculativeResult) -> None:
    """Acceptance figures, then a plain run at --verify-loops with the same arguments for the speed-up."""
    s, a = res.stats, args
    t0 = time.perf_counter()
    plain = model.generate(prompt, a.max_tokens, a.verify_loops, a.temperature, a.top_k, a.top_p, a.seed)
    plain_s = time.perf_counter() - t0
    speedup = plain_s / s.time_s if s.time_s > 0 else 0.0
    same = "same tokens" if plain.tolist() == res.tokens.tolist() else "different tokens"
    print(
        f"speculate: acceptance {s.acceptance_rate:.1%} ({s.accepted}/{s.drafted} drafted), "
        f"{s.tokens_per_verify:.2f} tokens per verify pass ({s.verify_passes} passes), "
        f"{s.plain_steps} plain steps, finished {s.finished}",
        file=sys.stderr,
    )
    print(
        f"speed-up: {speedup:.2f}x ({s.time_s * 1e3:.0f} ms vs plain {plain_s * 1e3:.0f} ms at "
        f"{a.verify_loops} loops; {same})",
        file=sys.stderr,
    )
