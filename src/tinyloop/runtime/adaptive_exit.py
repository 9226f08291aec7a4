"""Generation with the looped families' exit mechanisms: Ouro's gate rules and per-token adaptive depth.

Per-token adaptive exit (Huginn's criteria, or Ouro's gate CDF) stops a decode token's loop early. Later
tokens still attend at every iteration, so the KV slots of the iterations a token skipped are filled with
the K/V of its last computed iteration, per body layer: the lookup Huginn calls "latest-m4" (newest
iteration <= the asked one, same layer). The copy is the depth schedule's helper (same rule), so both
features leave caches in the same state. The prompt always runs the full depth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tinyloop.cache.base import StepCache
from tinyloop.model.looped import IterationView, forward
from tinyloop.runtime.depth_schedule import fill_skipped_iterations
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.family_exit import ExitRule, exit_logits
from tinyloop.runtime.stats import GenerationStats

CRITERIA = ("kl", "entropy", "argmax", "latent", "gate")
# Huginn's "auto" thresholds (argmax: consecutive unchanged steps); gate: Ouro's CDF threshold q.
DEFAULT_THRESHOLDS = {"kl": 1e-3, "entropy": 1e-3, "argmax": 5.0, "latent": 0.03, "gate": 0.5}


@dataclass(frozen=True)
class ExitCriterion:
    """Stop a decode token's loop after iteration t (t + 1 >= min_loops) when:
    kl: KL(p_{t-1} || p_t) < threshold (p_{-1} uniform); entropy: |H_t - H_{t-1}| < threshold;
    argmax: the argmax has not changed for `threshold` consecutive iterations; latent:
    ||s_t - s_{t-1}|| / ||s_t|| < threshold (raw loop states); gate: Ouro's exit CDF >= threshold.
    """

    kind: str
    threshold: float | None = None
    min_loops: int = 1

    def __post_init__(self) -> None:
        if self.kind not in CRITERIA:
            raise ValueError(f"exit criterion must be one of {list(CRITERIA)}, got {self.kind!r}")
        t = self.value
        if not math.isfinite(t) or t < 0 or (self.kind == "argmax" and (t < 1 or t != int(t))):
            raise ValueError(f"exit threshold for {self.kind!r} must be a finite number >= 0 (argmax: integer >= 1)")
        if isinstance(self.min_loops, bool) or not isinstance(self.min_loops, int) or self.min_loops < 1:
            raise ValueError(f"min_loops must be an integer >= 1, got {self.min_loops!r}")

    @property
    def value(self) -> float:
        return DEFAULT_THRESHOLDS[self.kind] if self.threshold is None else float(self.threshold)


@dataclass
class _Tracker:
    """What a criterion remembers between iterations of one token."""

    crit: ExitCriterion
    vocab: int
    prev_logp: torch.Tensor | None = None
    prev_entropy: float | None = None
    prev_argmax: int = -1
    streak: int = 0
    survival: float = 1.0
    prev_state: torch.Tensor | None = None
    logits: torch.Tensor | None = field(default=None, repr=False)

    def needs_logits(self) -> bool:
        return self.crit.kind in ("kl", "entropy", "argmax")

    def should_exit(self, logits: torch.Tensor | None, state: torch.Tensor, gate: torch.Tensor | None) -> bool:
        kind, thr = self.crit.kind, self.crit.value
        if kind == "latent":
            prev, self.prev_state = self.prev_state, state
            assert prev is not None
            return float((state - prev).float().norm() / state.float().norm().clamp_min(1e-30)) < thr
        if kind == "gate":
            assert gate is not None
            self.survival *= 1.0 - float(torch.sigmoid(gate.float()))
            return 1.0 - self.survival >= thr
        assert logits is not None
        logp = torch.log_softmax(logits.double(), dim=-1)
        if kind == "kl":
            prev = self.prev_logp if self.prev_logp is not None else torch.full_like(logp, -math.log(self.vocab))
            self.prev_logp = logp
            return float((prev.exp() * (prev - logp)).sum()) < thr
        if kind == "entropy":
            ent = float(-(logp.exp() * logp).sum())
            prev_ent, self.prev_entropy = self.prev_entropy, ent
            return prev_ent is not None and abs(ent - prev_ent) < thr
        top = int(logp.argmax())
        self.streak = self.streak + 1 if top == self.prev_argmax else 0
        self.prev_argmax = top
        return self.streak >= int(thr)


def adaptive_decode_step(
    engine: Engine, cache: StepCache, token: int, loops: int, crit: ExitCriterion
) -> tuple[torch.Tensor, int]:
    """One decode token (batch row 0) with per-token exit: (logits [V] float32, iterations run)."""
    logits, depth = adaptive_rows_step(engine, cache, [token], [loops], [crit], [loops])
    return logits[0], depth[0]


@torch.inference_mode()
def adaptive_rows_step(
    engine: Engine,
    cache: Any,
    tokens: Sequence[int],
    depth: Sequence[int],
    criteria: Sequence[ExitCriterion | None],
    fill_to: Sequence[int],
) -> tuple[torch.Tensor, list[int]]:
    """One decode token per cache row, each at its own position: row b iterates at most depth[b] times and
    stops earlier when criteria[b] fires. Returns (logits [B, V] float32, iterations each row ran).

    A row that stopped keeps its state while the others go on; afterwards its body K/V of the iterations it
    skipped, up to fill_to[b], are filled by the one-row rule (`fill_skipped_iterations`), and the coda and
    head read its exit state, so each row's logits and cache equal the row stepped alone.
    """
    cfg = engine.cfg
    B = len(tokens)
    start = cache.lengths.clone()
    end = int(start.max()) + 1
    if end > cache.max_seq:
        raise ValueError(f"sequence of {end} tokens exceeds the cache's max_seq_len {cache.max_seq}")
    trackers = [None if c is None else _Tracker(c, cfg.vocab_size) for c in criteria]
    ran = list(depth)
    running = [True] * B

    def exit_rows(view: IterationView) -> torch.Tensor:
        """Rows whose depth is reached or whose criterion fires after this iteration."""
        t = view.loop
        stopped = [False] * B
        checks = []
        for b, tr in enumerate(trackers):
            if not running[b]:
                continue
            if t + 1 == depth[b]:
                running[b], stopped[b] = False, True
            if tr is None or t + 1 == depth[b] or t + 1 < tr.crit.min_loops:
                continue
            checks.append(b)
        if checks:
            wants_logits = any(trackers[b].needs_logits() for b in checks)  # type: ignore[union-attr]
            check = view.logits()[:, -1] if wants_logits else None
            for b in checks:
                tr = trackers[b]
                assert tr is not None
                tr.prev_state = view.previous[b : b + 1]
                row_logits = check[b] if check is not None and tr.needs_logits() else None
                row_gate = view.gate[b, -1] if view.gate is not None and tr.crit.kind == "gate" else None
                if tr.should_exit(row_logits, view.state[b : b + 1], row_gate):
                    ran[b], running[b], stopped[b] = t + 1, False, True
        return torch.tensor(stopped, device=engine.device)

    with engine.lock:
        positions = start.view(B, 1).to(engine.device)
        ctx = engine.context(positions, cache, end)
        begin_step = getattr(cache, "begin_step", None)
        if begin_step is not None:  # the sliding window lays out its own span
            ctx.mask = begin_step(positions, start, torch.ones(B, dtype=torch.long))
        ids = torch.tensor(list(tokens), dtype=torch.long, device=engine.device).view(B, 1)
        # The coda (and its K/V) and the head see every row's exit state.
        out = forward(engine.weights, cfg, ids, ctx, max(depth), dtype=engine.dtype, noise=engine.noise,
                      on_iteration=exit_rows)  # fmt: skip
        assert out.logits is not None
        logits = out.logits[:, -1]
        cache.lengths = torch.maximum(cache.lengths, start + 1)
        for b in range(B):
            if ran[b] < fill_to[b]:
                pos = int(start[b])
                fill_skipped_iterations(cache, ran[b], fill_to[b], pos, pos + 1, row=b if B > 1 else None)
    return logits, ran


@dataclass
class FamilyStats(GenerationStats):
    exit_depths: list[int] = field(default_factory=list)  # iterations run per generated token (prompt: full)


def rule_step(engine: Engine, cache: StepCache, tokens: torch.Tensor, loops: int, rule: ExitRule) -> torch.Tensor:
    out = engine.step(tokens, cache, loops, last_only=True, collect_states=not rule.is_last)
    return exit_logits(engine.weights, engine.cfg, out, rule, slice(-1, None))[0, -1]
