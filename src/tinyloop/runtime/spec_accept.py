"""Speculative acceptance math: greedy match and rejection sampling (pure functions of distributions)."""

from __future__ import annotations

import torch

from tinyloop.runtime.sampling import draw


def accept_draft(
    p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator | None
) -> tuple[bool, int | None]:
    """Accept draft `token` (drawn from q) with probability min(1, p[token] / q[token]); on rejection draw
    the replacement from normalize(max(0, p - q)). p, q: float64 [V] distributions (each sums to 1).

    Returns (accepted, replacement or None). The committed token is then distributed exactly as p.
    """
    ratio = float(p[token]) / float(q[token])
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if u < min(1.0, ratio):
        return True, None
    residual = (p - q).clamp_min(0.0)
    total = float(residual.sum())
    # Rejection implies p[token] < q[token], so some mass remains; guard against rounding anyway.
    dist = residual / total if total > 0 else p
    return False, draw(dist, generator)


def normalized(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum()
