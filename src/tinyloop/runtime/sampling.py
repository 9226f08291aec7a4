"""Next-token sampling: greedy, temperature, top-k, top-p (pure functions of logits)."""

from __future__ import annotations

import torch

from tinyloop.errors import NonFiniteLogitsError


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """One token id from logits [V]. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.

    Raises NonFiniteLogitsError on NaN or inf logits (a forbidden token's -inf is fine)."""
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise NonFiniteLogitsError()
    if temperature == 0.0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(filtered_probs(logits, temperature, top_k, top_p), 1, generator=generator))


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution `sample_next` draws from (temperature > 0): float64 [V] on the CPU."""
    scores = logits.double().cpu() / temperature
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
