"""What the steps of self-speculative decoding cost: a layer-count prior, then the times measured on this machine.

The adaptive draft policy (spec_policy.py) compares speculation's expected tokens per second with plain
decoding's. Constants fitted on one machine do not hold on another (a verify pass of several rows costs
what the machine's matmuls and per-op overheads make it), so `StepCosts` replaces the prior with running
estimates from the steps a request actually runs: a draft step, a verify pass of n rows, a plain step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tinyloop.config import ArchConfig

# The prior. A step's fixed work (embedding, head, sampling, launch) in units of one layer pass, and the
# extra cost of each further token in a multi-token step relative to the first.
STEP_OVERHEAD_LAYERS = 2.0
EXTRA_TOKEN_COST = 0.15
# On CUDA a one-token step runs the INT4 GEMV while a verification pass of 5-16 tokens runs the split-K
# tensor-core kernel (two launches per matrix, about a quarter of the GEMV's bandwidth). Measured on an H200
# at 2 / 8 with every draft accepted: each further token cost 0.41 of a step
# for seed-407m (d_model 2048, bound by weight bytes) and 0.98 for the built-in tiny (d_model 384, bound
# by launches), so CUDA models below CUDA_LARGE_D_MODEL count a full step and decode plain. On Hopper, 16-bit
# verification passes take the warpgroup INT4 kernel (KernelPolicy.mma_int4_few_tokens), where a further token
# costs about 0.05 of a step (H100, seed-407m: 5 rows 1.50 ms, one 1.25); the prior keeps the other GPUs' cost,
# under which the policy still drafts on seed-407m (1.49x plain against 1.52x always drafting).
EXTRA_TOKEN_COST_BY_DEVICE = {"cpu": EXTRA_TOKEN_COST, "cuda": 0.45}
CUDA_SMALL_MODEL_EXTRA_TOKEN_COST = 1.0
CUDA_LARGE_D_MODEL = 1024

# An estimate is the median of a kind's last samples: a step's time has a long tail (a first call's
# allocations, another process taking the core), and a median of few samples is not biased against the
# kinds timed more often, as a minimum would be.
SAMPLES_KEPT = 9
# Rounds after which a plain step is timed (against the round before it), and the plain steps that follow a
# round closely enough to count. A plain step runs the draft step's code with more loops, so the prior's
# ratio holds well; it stays in the median as PLAIN_PRIOR_SAMPLES samples, which keeps the estimate from
# swinging with a few samples taken while the load changed between a round and the plain step.
PLAIN_REFRESH_ROUNDS = 8
PLAIN_NEAR_ROUND = 2
PLAIN_PRIOR_SAMPLES = 2


class _Samples:
    """The last SAMPLES_KEPT samples (times or ratios of times) of one kind of step, and their median."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=SAMPLES_KEPT)
        self.count = 0
        self.median = 0.0

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.count += 1
        self.median = statistics.median(self.recent)


def _slope(points: list[tuple[int, float]]) -> float:
    n = len(points)
    mean_r = sum(r for r, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    num = sum((r - mean_r) * (s - mean_s) for r, s in points)
    den = sum((r - mean_r) ** 2 for r, _ in points)
    return max(num / den, 0.0) if den > 0 else 0.0


@dataclass(frozen=True)
class LayerCosts:
    """The prior: a step's cost in layer passes, from the architecture and the loop counts alone."""

    cfg: ArchConfig
    draft_loops: int
    verify_loops: int
    extra_token_cost: float = EXTRA_TOKEN_COST

    @classmethod
    def for_device(cls, cfg: ArchConfig, draft_loops: int, verify_loops: int, device_type: str) -> LayerCosts:
        extra = EXTRA_TOKEN_COST_BY_DEVICE.get(device_type, EXTRA_TOKEN_COST)
        if device_type == "cuda" and cfg.d_model < CUDA_LARGE_D_MODEL:
            extra = CUDA_SMALL_MODEL_EXTRA_TOKEN_COST
        return cls(cfg, draft_loops, verify_loops, extra)

    def plain(self) -> float:
        c = self.cfg
        return c.n_prelude + self.verify_loops * c.n_body + c.n_coda + STEP_OVERHEAD_LAYERS

    def draft(self) -> float:
        c = self.cfg
        return c.n_prelude + self.draft_loops * c.n_body + c.n_coda + STEP_OVERHEAD_LAYERS

    def verify(self, rows: int) -> float:
        """A verification pass over `rows` positions, resumed at the draft depth."""
        c = self.cfg
        resumed = (self.verify_loops - self.draft_loops) * c.n_body + c.n_coda
        return resumed * (1 + self.extra_token_cost * (rows - 1)) + STEP_OVERHEAD_LAYERS


@dataclass
class StepCosts:
    """What a plain step, a draft step and a verify pass of n rows cost, from the steps timed with `clock`.

    Another process on the machine can double every step's time within a second, so costs are measured as
    ratios of steps timed together: a verify pass against the draft steps of its own round, a plain step
    against the draft steps of the round just before it. Costs are returned in seconds at the typical draft
    step's time (only their ratios decide); the layer-pass prior stands in for a ratio not measured yet.

    learn False: samples are ignored and the prior alone decides (in layer passes), so the policy's choices,
    and with them a seeded sampled request's tokens, repeat exactly from run to run. Greedy tokens never
    depend on the choices.
    """

    prior: LayerCosts
    learn: bool = True
    clock: Callable[[], float] = time.perf_counter
    _draft: _Samples = field(default_factory=_Samples, init=False, repr=False)  # seconds per draft step
    _plain: _Samples = field(default_factory=_Samples, init=False, repr=False)  # plain step / draft step
    _verify: dict[int, _Samples] = field(default_factory=dict, init=False, repr=False)  # by rows, / draft step
    _last_draft_step: float = field(default=0.0, init=False, repr=False)
    _plain_since_round: int = field(default=0, init=False, repr=False)
    rounds_since_plain: int = field(default=0, init=False)

    def add_round(self, draft_steps: int, draft_seconds: float, rows: int, verify_seconds: float) -> None:
        """A round's timings: `draft_steps` draft steps, then a verify pass over `rows` positions."""
        if not self.learn or draft_steps <= 0 or draft_seconds <= 0.0:  # a clock too coarse to time it
            return
        step = draft_seconds / draft_steps
        self._draft.add(step)
        self._verify.setdefault(rows, _Samples()).add(verify_seconds / step)
        self._last_draft_step = step
        self._plain_since_round = 0
        self.rounds_since_plain += 1

    def add_plain(self, seconds: float) -> None:
        """A plain step's time; it counts when it comes right after a round (PLAIN_NEAR_ROUND steps)."""
        if not self.learn:
            return
        if self._draft.count and self._plain_since_round < PLAIN_NEAR_ROUND:
            self._plain.add(seconds / self._last_draft_step)
            self.rounds_since_plain = 0
        self._plain_since_round += 1

    def wants_plain_sample(self) -> bool:
        """Whether the next step should be a plain one, to time it (every PLAIN_REFRESH_ROUNDS rounds)."""
        return self.learn and self.rounds_since_plain >= PLAIN_REFRESH_ROUNDS

    def draft(self) -> float:
        return self._draft.median if self._draft.count else self.prior.draft()

    def plain(self) -> float:
        prior = self.prior.plain() / self.prior.draft()
        return statistics.median([*self._plain.recent, *[prior] * PLAIN_PRIOR_SAMPLES]) * self.draft()

    def verify(self, rows: int) -> float:
        return self._verify_ratio(rows) * self.draft()

    def round(self, k: int) -> float:
        """A round drafting k tokens: k + 1 draft steps (the last one for the bonus position), one verify pass."""
        return (k + 1) * self.draft() + self.verify(k + 1)

    def _verify_ratio(self, rows: int) -> float:
        """Measured at `rows`, else read off the measured row counts: linear between two of them, the
        least-squares slope (at least 0) above them, the prior's shape below them or from a single one."""
        if rows in self._verify:
            return self._verify[rows].median
        points = sorted((r, samples.median) for r, samples in self._verify.items())
        if not points:
            return self.prior.verify(rows) / self.prior.draft()
        below = [p for p in points if p[0] < rows]
        above = [p for p in points if p[0] > rows]
        if below and above:
            (r0, s0), (r1, s1) = below[-1], above[0]
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        if above or len(points) == 1:
            r0, s0 = above[0] if above else points[0]
            return s0 * self.prior.verify(rows) / self.prior.verify(r0)
        return points[-1][1] + _slope(points) * (rows - points[-1][0])
