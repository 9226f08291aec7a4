"""With temperature > 0, speculative output is distributed as plain sampling at the verify depth.

Chi-square tests at significance 0.001 (Wilson-Hilferty critical values): the rejection-sampling step
alone on fixed distributions, and end to end on the joint law of the first two new tokens of a tiny
model (top_k=3, so the exact law has 9 cells, computed from full forwards).
"""

from __future__ import annotations

import math

import torch
from gen_helpers import tiny_engine

from tinyloop.runtime.sampling import filtered_probs
from tinyloop.runtime.spec_accept import accept_draft
from tinyloop.runtime.speculative import SpecConfig, SpeculativeStats, speculative_tokens
from tinyloop.sampling import SamplingParams

Z_999 = 3.090  # one-sided normal quantile for significance 0.001


def chi2_critical(df: int, z: float = Z_999) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a sample fell outside the support"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def test_accept_draft_reproduces_the_target_distribution() -> None:
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.4, 0.1, 0.0, 0.2, 0.2], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(6, dtype=torch.float64)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    for d in drafts.tolist():
        ok, repl = accept_draft(p, q, d, gen)
        counts[d if ok else repl] += 1
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_critical(df), (stat, counts.tolist())


def test_speculative_sampling_matches_the_verifier_end_to_end() -> None:
    engine = tiny_engine(contractive=0.05)
    verify, temp, top_k, top_p = 4, 1.5, 3, 1.0
    prompt = torch.tensor(list(b"Hello"))
    # The exact joint law of (x1, x2) under plain sampling at `verify` loops.
    first = engine.step(prompt[None], None, verify, last_only=True).logits[0, -1]
    p1 = filtered_probs(first, temp, top_k, top_p)
    p1 = p1 / p1.sum()
    support = p1.nonzero().flatten().tolist()
    cells = {}
    for x1 in support:
        nxt = engine.step(torch.cat((prompt, torch.tensor([x1])))[None], None, verify, last_only=True).logits[0, -1]
        p2 = filtered_probs(nxt, temp, top_k, top_p)
        p2 = p2 / p2.sum()
        for x2 in p2.nonzero().flatten().tolist():
            cells[(x1, x2)] = float(p1[x1] * p2[x2])
    keys = sorted(cells)
    probs = torch.tensor([cells[k] for k in keys], dtype=torch.float64)
    counts = torch.zeros(len(keys), dtype=torch.float64)
    stats = SpeculativeStats()
    cache = engine.new_cache(1, 16, verify)
    spec = SpecConfig(1, verify, 2, adaptive=False)
    for seed in range(500):
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=seed)
        x1, x2, _ = speculative_tokens(engine, cache, prompt, 3, spec, params, stats)
        counts[keys.index((x1, x2))] += 1
    assert 0 < stats.accepted < stats.drafted  # both acceptance and rejection happened
    stat, df = chi2_stat(counts, probs)
    assert stat < chi2_critical(df), (stat, df, counts.tolist(), probs.tolist())
