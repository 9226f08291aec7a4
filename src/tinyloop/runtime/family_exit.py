"""Ouro's learned exit gate: the exit distribution over loops and the three ways to read logits from it.

λ_t = σ(g_t); p_t = λ_t ∏_{j<t}(1-λ_j) for t < n-1 and p_{n-1} = ∏_{j<n-1}(1-λ_j) (the last loop takes the
remaining mass). All in float32, whatever the compute dtype: the reference computes this in the model
dtype, and in bf16 its CDF rounds to 1.0 once the survival is below ~2^-9, so a bf16 reference can exit
before the last loop at threshold 1.0 where we (and its fp32 run) do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.config import ArchConfig
from tinyloop.model.looped import ForwardOutput, head
from tinyloop.model.weights import ModelWeights


@dataclass(frozen=True)
class ExitRule:
    """How the output loop is chosen for each token (all loops are computed, as in the reference).

    threshold q: exit at the first loop whose CDF >= q (else the last); exit_at_step k: loop k (0-based);
    weighted: Σ_t p_t · head(h_t). At most one of the three; none means the last loop.
    """

    threshold: float | None = None
    exit_at_step: int | None = None
    weighted: bool = False

    def __post_init__(self) -> None:
        chosen = (self.threshold is not None) + (self.exit_at_step is not None) + bool(self.weighted)
        if chosen > 1:
            raise ValueError("choose at most one of exit_threshold, exit_at_step and weighted_exit")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"exit_threshold must be in [0, 1], got {self.threshold!r}")
        if self.exit_at_step is not None and self.exit_at_step < 0:
            raise ValueError(f"exit_at_step must be >= 0, got {self.exit_at_step!r}")

    @property
    def is_last(self) -> bool:
        return self.threshold is None and self.exit_at_step is None and not self.weighted


def check_supported(cfg: ArchConfig, rule: ExitRule, loops: int) -> None:
    if rule.is_last:
        return
    if not cfg.exit_gate and (rule.threshold is not None or rule.weighted):
        raise ValueError("exit_threshold and weighted_exit need a model with an exit gate (Ouro)")
    if cfg.n_coda or cfg.head_norm:
        raise ValueError("exit rules read the head from the loop state; this model has a coda or head norm")
    if rule.exit_at_step is not None and rule.exit_at_step >= loops:
        raise ValueError(f"exit_at_step {rule.exit_at_step} needs more than {loops} loops")


def exit_pdf(gates: list[torch.Tensor]) -> torch.Tensor:
    """gates: one [B, T] logit tensor per loop -> the exit distribution [B, T, n] (float32)."""
    lam = torch.sigmoid(torch.stack([g.float() for g in gates], dim=-1))
    survival = torch.cumprod(1.0 - lam, dim=-1)
    before = torch.cat((torch.ones_like(survival[..., :1]), survival[..., :-1]), dim=-1)
    pdf = lam * before
    pdf[..., -1] = before[..., -1]
    return pdf


def threshold_steps(pdf: torch.Tensor, q: float) -> torch.Tensor:
    """The first loop with CDF >= q, or the last loop when none: [B, T] long."""
    hit = torch.cumsum(pdf, dim=-1) >= q
    n = pdf.shape[-1]
    first = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(hit[..., 0], n - 1, dtype=torch.long))
    return first.long()


def exit_logits(w: ModelWeights, cfg: ArchConfig, out: ForwardOutput, rule: ExitRule, positions: slice) -> torch.Tensor:
    """Logits [B, T', V] under `rule` from a forward run with collect_states (loop states after the two
    leading entries). `positions` selects the token positions to read (e.g. the last one)."""
    if rule.is_last:
        assert out.logits is not None
        return out.logits
    assert out.states is not None
    states = [s[:, positions] for s in out.states[2:]]
    if rule.exit_at_step is not None:
        return head(w, cfg, states[rule.exit_at_step])
    pdf = exit_pdf([g[:, positions] for g in out.gates])
    if rule.weighted:
        return sum((pdf[..., t, None] * head(w, cfg, s) for t, s in enumerate(states)), torch.zeros(()))
    assert rule.threshold is not None
    steps = threshold_steps(pdf, rule.threshold)  # [B, T']
    stacked = torch.stack(states, dim=0)  # [n, B, T', d]
    idx = steps[None, :, :, None].expand(1, *stacked.shape[1:])
    return head(w, cfg, stacked.gather(0, idx)[0])
