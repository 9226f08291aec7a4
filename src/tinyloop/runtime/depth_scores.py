"""Log-probabilities of a sequence's own next tokens at several depths from one forward (evaluation).

The deepest depth runs once; each shallower depth re-applies only the exit path (coda, final norm, head)
to that iteration's state, which is exactly what a separate run at that depth computes (the loop's first
iterations do not depend on how many follow). Only per-token values are kept, never [L, T, V] logits.

With an exit criterion every loop still runs for every position; a position reads the logits of the
first depth whose check fires (Huginn's criteria, Ouro's gate CDF), as `ExitCriterion` defines them for
decoding, and at most the asked depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tinyloop.model.looped import exit_hidden, head, initial_state
from tinyloop.runtime.adaptive_exit import ExitCriterion
from tinyloop.runtime.engine import Engine


@dataclass(frozen=True)
class DepthLogprobs:
    """For each asked depth (ascending), per position t < T-1 of tokens [B, T]:
    logprob float64 [D, B, T-1] = log p(tokens[t+1] | tokens[..t]); greedy bool [D, B, T-1]: tokens[t+1]
    is the argmax; exit_depth int [D, B, T-1]: the depth whose logits were read."""

    depths: tuple[int, ...]
    logprob: torch.Tensor
    greedy: torch.Tensor
    exit_depth: torch.Tensor


@torch.inference_mode()
def depth_logprobs(
    engine: Engine, tokens: torch.Tensor, depths: tuple[int, ...], criterion: ExitCriterion | None = None
) -> DepthLogprobs:
    """tokens [B, T] from position 0 (right-padded rows are fine: a position only sees tokens before it)."""
    cfg, w = engine.cfg, engine.weights
    deepest = depths[-1]
    targets = tokens[:, 1:].long()
    if criterion is None and len(depths) == 1:
        out = engine.step(tokens, None, deepest)
        assert out.logits is not None
        lp, greedy = _target_scores(out.logits[:, :-1], targets)
        return DepthLogprobs(depths, lp[None], greedy[None], torch.full_like(lp, deepest, dtype=torch.long)[None])
    out = engine.step(tokens, None, deepest, collect_states=True)
    assert out.logits is not None and out.states is not None
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device)[None].expand(B, T)
    ctx = engine.context(positions, None, None)
    check = _Check(criterion, cfg.vocab_size, initial_state(cfg, out.states[1], positions, engine.noise))
    needed = set(depths) if criterion is None else set(range(1, deepest + 1))
    fired = torch.zeros(B, T - 1, dtype=torch.long, device=tokens.device)  # 0: no check fired yet
    read_lp = torch.zeros(B, T - 1, dtype=torch.float64, device=tokens.device)
    read_greedy = torch.zeros(B, T - 1, dtype=torch.bool, device=tokens.device)
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for depth in range(1, deepest + 1):
        if depth not in needed:
            continue
        state = out.states[1 + depth]
        logits = out.logits if depth == deepest else head(w, cfg, exit_hidden(w, cfg, state, ctx))
        logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
        lp, greedy = _gather(logp, logits[:, :-1], targets)
        if depth in depths:
            early = fired > 0
            rows.append((
                torch.where(early, read_lp, lp),
                torch.where(early, read_greedy, greedy),
                torch.where(early, fired, torch.full_like(fired, depth)),
            ))  # fmt: skip
        if criterion is not None and depth < deepest:
            gate = out.gates[depth - 1][:, :-1] if out.gates else None
            now = check.fires(depth, logp, state[:, :-1], gate) & (fired == 0)
            fired = torch.where(now, depth, fired)
            read_lp = torch.where(now, lp, read_lp)
            read_greedy = torch.where(now, greedy, read_greedy)
    lps, greedies, exits = zip(*rows, strict=True)
    return DepthLogprobs(depths, torch.stack(lps), torch.stack(greedies), torch.stack(exits))


def _target_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _gather(torch.log_softmax(logits.double(), dim=-1), logits, targets)


def _gather(logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp = logp.gather(-1, targets[..., None])[..., 0]
    return lp, logits.argmax(-1) == targets


class _Check:
    """ExitCriterion's per-iteration test, vectorised over positions (same state carried between depths)."""

    def __init__(self, criterion: ExitCriterion | None, vocab: int, start: torch.Tensor) -> None:
        self.criterion = criterion
        self.prev_logp: torch.Tensor | None = None
        self.prev_entropy: torch.Tensor | None = None
        self.prev_argmax: torch.Tensor | None = None
        self.streak: torch.Tensor | None = None
        self.survival: torch.Tensor | None = None
        self.prev_state = start[:, :-1]
        self.log_vocab = math.log(vocab)

    def fires(self, depth: int, logp: torch.Tensor, state: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Whether iteration `depth` (1-based) ends the loop, [B, T-1]; called for every depth in order."""
        crit = self.criterion
        assert crit is not None
        checked = depth >= crit.min_loops
        kind, thr = crit.kind, crit.value
        no = torch.zeros(logp.shape[:-1], dtype=torch.bool, device=logp.device)
        if kind == "latent":
            prev, self.prev_state = self.prev_state, state
            ratio = (state - prev).float().norm(dim=-1) / state.float().norm(dim=-1).clamp_min(1e-30)
            return ratio < thr if checked else no
        if kind == "gate":
            if gate is None:
                raise ValueError("the 'gate' exit criterion needs a model with an exit gate (Ouro)")
            if not checked:  # as in decoding, the CDF accumulates over the checked iterations
                return no
            survival = self.survival if self.survival is not None else torch.ones_like(gate, dtype=torch.float32)
            self.survival = survival * (1.0 - torch.sigmoid(gate.float()))
            return 1.0 - self.survival >= thr
        if not checked:  # the decode loop's trackers see iterations from min_loops on
            return no
        if kind == "kl":
            prev = self.prev_logp if self.prev_logp is not None else torch.full_like(logp, -self.log_vocab)
            self.prev_logp = logp
            return (prev.exp() * (prev - logp)).sum(-1) < thr
        if kind == "entropy":
            entropy = -(logp.exp() * logp).sum(-1)
            prev_entropy, self.prev_entropy = self.prev_entropy, entropy
            return no if prev_entropy is None else (entropy - prev_entropy).abs() < thr
        top = logp.argmax(-1)
        if self.prev_argmax is None or self.streak is None:
            self.streak = torch.zeros_like(top)
        else:
            self.streak = torch.where(top == self.prev_argmax, self.streak + 1, torch.zeros_like(top))
        self.prev_argmax = top
        return self.streak >= int(thr)
