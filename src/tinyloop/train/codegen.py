"""Code-generation checks: held-out function headers, seeded sampling, and the parse rule.

Parse rule for one sampled function body (`function_parses`):
1. the continuation is cut at its first NUL byte (end of file), then after its last newline
   (a trailing partial line is dropped); no newline at all fails;
2. the body is the leading run of lines that are blank or start with a space or tab; the first
   non-blank line at column 0 ends the function (and the generation stops there);
3. a body without any non-blank line fails;
4. it passes when `ast.parse(def_line + "\\n" + body)` succeeds. Headers are top-level `def` lines,
   so no dedent is needed. A body cut mid-statement (open bracket, unterminated string) fails.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tinyloop.runtime.engine import Engine

DEF_LINE = re.compile(rb"^def \w+\(.*\):$", re.MULTILINE)
TEMPERATURE = 0.8
TOP_K = 50


@dataclass(frozen=True)
class Header:
    relpath: str
    def_line: str
    prompt: bytes


def find_headers(docs: Sequence[tuple[str, bytes]], count: int = 20, context: int = 300) -> list[Header]:
    """Top-level one-line `def` headers, taken round-robin over the files (first def of every file in
    order, then the second of each, ...) until `count`. The prompt is the whole lines within the
    `context` bytes before the def line, then the def line and a newline."""
    per_file = [list(DEF_LINE.finditer(data)) for _, data in docs]
    out: list[Header] = []
    rank = 0
    while len(out) < count and any(rank < len(m) for m in per_file):
        for (relpath, data), matches in zip(docs, per_file, strict=True):
            if rank < len(matches) and len(out) < count:
                m = matches[rank]
                start = max(0, m.start() - context)
                if start > 0:
                    newline = data.find(b"\n", start, m.start())
                    start = m.start() if newline < 0 else newline + 1
                prompt = data[start : m.end()] + b"\n"
                out.append(Header(relpath, m.group().decode("utf-8", "replace"), prompt))
        rank += 1
    return out


def body_lines(continuation: str) -> list[str] | None:
    """Rules 1-2: the complete, indented-or-blank lines that follow the header; None if not one line."""
    text = continuation.split("\x00", 1)[0]
    cut = text.rfind("\n")
    if cut < 0:
        return None
    body: list[str] = []
    for line in text[:cut].split("\n"):
        if line.strip() and not line.startswith((" ", "\t")):
            break
        body.append(line)
    return body


def function_parses(def_line: str, continuation: str) -> bool:
    body = body_lines(continuation)
    if body is None or not any(line.strip() for line in body):
        return False
    try:
        ast.parse(def_line + "\n" + "\n".join(body) + "\n")
    except (SyntaxError, ValueError):
        return False
    return True


def function_ended(generated: bytes) -> bool:
    """True once a complete non-blank line at column 0 follows the body, or a NUL byte appears."""
    if b"\x00" in generated:
        return True
    if not generated.endswith(b"\n"):
        return False
    last = generated[:-1].rsplit(b"\n", 1)[-1]
    return bool(last.strip()) and not last.startswith((b" ", b"\t"))


def sample_token(
    logits: torch.Tensor, gen: torch.Generator, temperature: float = TEMPERATURE, top_k: int = TOP_K
) -> int:
    scores = logits.double().cpu() / temperature
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen))


def generate(
    engine: Engine,
    prompts: Sequence[bytes],
    loops: int,
    max_new: int,
    seeds: Sequence[int],
    stop_at_function_end: bool = False,
) -> list[bytes]:
    """Sample up to max_new bytes after each prompt (temperature TEMPERATURE, top-k TOP_K), all prompts
    decoded together as one batch; row i draws from its own generator seeded with seeds[i]."""
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    width = max(len(p) for p in prompts)
    cache = engine.new_cache(len(prompts), width + max_new, loops)
    batch = torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts])
    valid = torch.tensor([len(p) for p in prompts])
    out = engine.step(batch, cache, loops, valid=valid, last_only=True)
    generated = [bytearray() for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new):
        assert out.logits is not None
        nxt = []
        for i, g in enumerate(generated):
            if done[i]:  # finished rows keep a slot in the batch; what they are fed is never read
                nxt.append(0)
                continue
            g.append(sample_token(out.logits[i, -1], gens[i]))
            nxt.append(g[-1])
            done[i] = len(g) >= max_new or (stop_at_function_end and function_ended(bytes(g)))
        if all(done):
            break
        out = engine.step(torch.tensor(nxt)[:, None], cache, loops, last_only=True)
    return [bytes(g) for g in generated]


def parse_rate(
    engine: Engine, headers: Sequence[Header], loops: int, max_new: int = 256, seed: int = 0
) -> tuple[float, list[dict[str, object]]]:
    """Share of headers whose sampled continuation passes the parse rule; header i samples with seed + i."""
    if not headers:
        return 0.0, []
    results: list[dict[str, object]] = []
    seeds = [seed + i for i in range(len(headers))]
    conts = generate(engine, [h.prompt for h in headers], loops, max_new, seeds, stop_at_function_end=True)
    for h, cont in zip(headers, conts, strict=True):
        text = cont.decode("utf-8", "replace")
        results.append(
            {"file": h.relpath, "def": h.def_line, "parses": function_parses(h.def_line, text), "sample": text}
        )
    passed = sum(bool(r["parses"]) for r in results)
    return (passed / len(results) if results else 0.0), results
