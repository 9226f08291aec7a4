"""Generation benchmarks (CPU): speculative vs plain decoding, greedy identity on held-out prompts, and the
per-token cost of grammar masks for the byte vocabulary and a 49,152-token BPE vocabulary.

    python bench/cpu_generation.py [--model tiny] [--tokens 64] [--pairs 2/8] [--repeats 3] [--identity-prompts 50]
        [--dtype float32|bfloat16] [--out FILE.json]

Speed rows also time the steps a round is made of (medians of 9): a plain one-token step, a draft step, and a
verify pass over draft_ahead + 1 positions resumed from their drafted states.

Uses the built-in `tiny` model when its file exists, else a random-weight model of the same architecture (INT4,
group size 64, as the built-in file).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tinyloop
from tinyloop import Grammar, Model
from tinyloop.grammar.vocab import TokenVocab, byte_level_pieces
from tinyloop.runtime.speculative import SpecConfig, speculative_tokens
from tinyloop.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / ".carry" / "corpus"


def model_path(name: str, scratch: Path) -> tuple[str, str]:
    builtin = ROOT / "src" / "tinyloop" / "builtin" / "tiny.tinyloop"
    if name == "tiny" and builtin.exists():
        return str(builtin), "built-in tiny (trained)"
    from tinyloop.format.writer import write_model
    from tinyloop.layout import model_specs
    from tinyloop.train.tiny_config import TINY_CONFIG

    gen = torch.Generator().manual_seed(0)
    flat = {}
    for spec in model_specs(TINY_CONFIG):
        scale = 0.02 if spec.role != "vector" else 0.0
        flat[spec.name] = (
            1.0 + torch.zeros(spec.shape) if scale == 0 else scale * torch.randn(spec.shape, generator=gen)
        )
    path = scratch / "tiny-random.tinyloop"
    write_model(path, TINY_CONFIG, flat, progress=False, bits=4, group_size=64, float_dtype="F32")
    return str(path), "random weights, TINY_CONFIG architecture, INT4 as the built-in"


def val_prompts(n: int, corpus: Path, length: int = 64) -> list[list[int]]:
    data = np.fromfile(corpus / "val.bin", dtype=np.uint8)
    offsets = np.linspace(0, len(data) - length - 1, n).astype(int)
    return [data[o : o + length].astype(np.int32).tolist() for o in offsets]


def timed(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def bench_speed(
    m: Model, prompts: list[list[int]], tokens: int, pairs: list[tuple[int, int]], repeats: int
) -> list[dict]:
    """Tokens/s of each variant over the prompts; each (prompt, variant) takes the fastest of `repeats`
    interleaved runs, so a burst of load from another process on a shared machine hits one run, not a mean."""
    rows = []
    for d, v in pairs:
        variants = ("plain", "adaptive", "adaptive_no_estimate", "fixed", "recompute")
        best: dict[str, list[float]] = {name: [] for name in variants}
        drafted = accepted = passes = spec_tok = plain_steps = 0
        recompute = SpecConfig(d, v, 4, adaptive=False, resume_verify=False)
        no_estimate = SpecConfig(d, v, 4, prefill_estimate=False)
        for p in prompts:
            times: dict[str, list[float]] = {name: [] for name in best}
            for _ in range(repeats):
                _, t = timed(m.generate, p, tokens, v, temperature=0)
                times["plain"].append(t)
                res, t = timed(m.generate_speculative, p, tokens, d, v, 4, adaptive=True)
                times["adaptive"].append(t)
                fixed, t = timed(m.generate_speculative, p, tokens, d, v, 4, adaptive=False)
                times["fixed"].append(t)
                for name, spec in (("adaptive_no_estimate", no_estimate), ("recompute", recompute)):
                    with m._request_cache(v) as cache:
                        run = speculative_tokens(
                            m._engine, cache, torch.tensor(p), tokens, spec, SamplingParams(temperature=0.0)
                        )
                        _, t = timed(list, run)
                    times[name].append(t)
                drafted += fixed.stats.drafted
                accepted += fixed.stats.accepted
                passes += fixed.stats.verify_passes
                spec_tok += fixed.stats.spec_tokens
                plain_steps += res.stats.plain_steps
            for name, ts in times.items():
                best[name].append(min(ts))
        n = len(prompts) * tokens
        plain_tok_s = n / sum(best["plain"])
        adaptive_tok_s = n / sum(best["adaptive"])
        rows.append(
            dict(
                draft=d,
                verify=v,
                plain_tok_s=plain_tok_s,
                spec_adaptive_tok_s=adaptive_tok_s,
                adaptive_vs_plain=adaptive_tok_s / plain_tok_s,
                spec_adaptive_no_estimate_tok_s=n / sum(best["adaptive_no_estimate"]),
                spec_fixed_tok_s=n / sum(best["fixed"]),
                spec_fixed_recompute_tok_s=n / sum(best["recompute"]),
                acceptance=accepted / max(drafted, 1),
                tokens_per_verify=spec_tok / max(passes, 1),
                adaptive_plain_step_share=plain_steps / (n * repeats),
                **step_ms(m, prompts[0], d, v, draft_ahead=4),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def step_ms(m: Model, prompt: list[int], draft: int, verify: int, draft_ahead: int) -> dict[str, float]:
    """Median milliseconds of a plain step, a draft step and a verify pass over draft_ahead + 1 positions."""
    engine = m._engine

    def median_ms(step, repeats: int = 9) -> float:  # type: ignore[no-untyped-def]
        times = sorted(timed(step)[1] for _ in range(repeats))
        return times[repeats // 2] * 1e3

    with m._request_cache(verify) as cache:
        assert cache is not None
        engine.step(torch.tensor([prompt]), cache, verify, last_only=True)
        end = int(cache.lengths[0])
        x = torch.tensor([[prompt[-1]]])
        rows = torch.tensor([prompt[-draft_ahead - 1 :]])
        drafted = engine.step(rows, cache, draft)
        resume = drafted.resume_at(draft)

        def one(loops: int) -> None:
            cache.truncate(end)
            engine.step(x, cache, loops, last_only=True)

        def verify_pass() -> None:
            engine.step(rows, cache, verify, start=torch.tensor([end]), resume=resume)

        plain_ms, draft_ms = median_ms(lambda: one(verify)), median_ms(lambda: one(draft))
        cache.truncate(end)
        engine.step(rows, cache, draft)
        return dict(plain_step_ms=plain_ms, draft_step_ms=draft_ms, verify_pass_ms=median_ms(verify_pass))


def check_identity(m: Model, prompts: list[list[int]], tokens: int, pairs: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for d, v in pairs:
        same = 0
        for p in prompts:
            plain = m.generate(p, tokens, v, temperature=0)
            res = m.generate_speculative(p, tokens, d, v, 4)
            same += int(np.array_equal(plain, res.tokens))
        rows.append(dict(draft=d, verify=v, identical=same, prompts=len(prompts), tokens=tokens))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def mask_cost(vocab: TokenVocab, pattern: str, steps: int = 2000) -> dict:
    g = Grammar(pattern)
    index, build_s = timed(g.index, vocab)
    logits = torch.randn(len(vocab))
    gen = torch.Generator().manual_seed(0)
    # Walk random valid paths (restarting at the end) and time the per-token work: mask lookup + apply.
    states, state = [], index.initial
    for _ in range(steps):
        if index.is_done(state):
            state = index.initial
        states.append(state)
        allowed = index.allowed(state).nonzero().flatten()
        state = index.advance(state, int(allowed[torch.randint(len(allowed), (1,), generator=gen)]))
    t0 = time.perf_counter()
    for s in states:
        masked = logits.masked_fill(index.forbidden(s), float("-inf"))
    per_token_us = (time.perf_counter() - t0) / steps * 1e6
    cold = Grammar(pattern).index(vocab)
    t0 = time.perf_counter()
    visited = set(states)
    for s in visited:
        cold.allowed(s)
    first_visit_us = (time.perf_counter() - t0) / len(visited) * 1e6
    del masked
    return dict(vocab=len(vocab), pattern=pattern[:60], index_build_ms=build_s * 1e3, states_visited=len(visited),
                per_token_us=per_token_us, first_visit_mask_us=first_visit_us)  # fmt: skip


def bpe_49k(corpus: Path) -> TokenVocab:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=49152, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    text = (corpus / "train.bin").read_bytes().decode("utf-8", "replace")
    lines = text.splitlines()
    tok.train_from_iterator(lines, trainer)
    return TokenVocab.from_pieces(byte_level_pieces(tok.get_vocab()), key="bench-bpe-49152")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--speed-prompts", type=int, default=5)
    ap.add_argument("--identity-prompts", type=int, default=50)
    ap.add_argument("--identity-tokens", type=int, default=32)
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="folder with val.bin and train.bin")
    ap.add_argument("--skip", default="", help="comma list of: speed, identity, poor, mask")
    ap.add_argument("--pairs", default="1/4,2/8,4/16", help="comma list of draft/verify loops")
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt and variant; the fastest counts")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16: INT4 matrices through torch's CPU INT4 kernel (the CLI's auto where it is native)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run(args, Path(scratch))


def run(args: argparse.Namespace, scratch: Path) -> None:
    pairs = [(int(d), int(v)) for d, v in (pair.split("/") for pair in args.pairs.split(","))]
    skip = set(args.skip.split(","))
    path, kind = model_path(args.model, scratch)
    report: dict = dict(
        model=kind, device="cpu", cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
        python=platform.python_version(), torch=torch.__version__, tinyloop=tinyloop.__version__,
    )  # fmt: skip
    print(json.dumps(report), flush=True)
    dtype = getattr(torch, args.dtype)
    report["dtype"] = args.dtype
    with Model(path, max_seq_len=256, device="cpu", dtype=dtype) as m:
        prompts = val_prompts(args.identity_prompts, args.corpus)
        if "speed" not in skip:
            report["speed"] = bench_speed(m, prompts[: args.speed_prompts], args.tokens, pairs, args.repeats)
        if "identity" not in skip:
            report["identity"] = check_identity(m, prompts, args.identity_tokens, pairs)
    if "poor" not in skip:
        # Drafts are poor on random weights: adaptive speculation must fall back to plain decoding.
        rpath, _ = model_path("random", scratch)
        with Model(rpath, max_seq_len=256, device="cpu", dtype=dtype) as m:
            report["poor_drafts"] = bench_speed(
                m, val_prompts(args.speed_prompts, args.corpus), args.tokens, pairs, args.repeats
            )
    if "mask" not in skip:
        date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
        schema = Grammar.from_json_schema(
            {
                "type": "object",
                "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["name", "n"],
            }  # fmt: skip
        ).pattern
        byte_vocab = TokenVocab.bytes_vocab(256)
        rows = [mask_cost(byte_vocab, date), mask_cost(byte_vocab, schema)]
        vocab, t = timed(bpe_49k, args.corpus)
        print(f"trained 49,152-token BPE in {t:.1f} s", flush=True)
        rows += [mask_cost(vocab, date), mask_cost(vocab, schema)]
        for r in rows:
            print(json.dumps(r), flush=True)
        report["mask"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
