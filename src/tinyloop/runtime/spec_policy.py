"""Adaptive draft length for self-speculative decoding, with a fall-back to plain decoding."""

from __future__ import annotations

from tinyloop.config import ArchConfig

# A step's fixed work (embedding, head, sampling, launch) in units of one layer pass, and the extra cost
# of each further token in a multi-token step relative to the first. Fixed constants keep the policy
# deterministic, so a seeded run repeats exactly.
STEP_OVERHEAD_LAYERS = 2.0
EXTRA_TOKEN_COST = 0.15
# On CUDA a one-token step runs the INT4 GEMV while a verification pass of 5-16 tokens runs the split-K
# tensor-core kernel (two launches per matrix, about a quarter of the GEMV's bandwidth). Measured on an H200
# at 2 / 8 with every draft accepted: each further token cost 0.41 of a step
# for seed-407m (d_model 2048, bound by weight bytes) and 0.98 for the built-in tiny (d_model 384, bound
# by launches), so CUDA models below CUDA_LARGE_D_MODEL count a full step and decode plain.
EXTRA_TOKEN_COST_BY_DEVICE = {"cpu": EXTRA_TOKEN_COST, "cuda": 0.45}
CUDA_SMALL_MODEL_EXTRA_TOKEN_COST = 1.0
CUDA_LARGE_D_MODEL = 1024
# Plain steps between probe rounds while speculation does not pay: a short first pause (one unlucky round
# on a good workload costs little), then long ones that double up to the cap.
BACKOFF_STEPS = (8, 64)
BACKOFF_CAP = 512
# The most prompt positions the prefill's agreement estimate counts as (see prime).
PRIOR_POSITIONS = 8.0


class DraftPolicy:
    """Chooses how many tokens to draft next (0: take a plain full-depth step instead).

    Adaptive: the prefill measures how often the draft and verify depths agree over the prompt (prime);
    without that estimate the first round drafts one token (the cheapest probe). The draft length doubles
    after each fully accepted round up to `draft_ahead`, then grows by one up to 2 x draft_ahead, and
    shrinks to one past the accepted count after a rejection. The per-token acceptance rate is tracked
    (decayed counts). A fully accepted round is followed by another (it produced k + 1 tokens for less than
    k + 1 plain steps, see can_pay); after a rejection, when a layer-pass cost model says that even the best
    draft length would cost more per token than plain decoding, speculation pauses for plain steps (8,
    then 64, doubling up to 512 while it stays unprofitable) and then probes again with a one-token draft.
    A round the cost model finds profitable resets the pauses to 8. A prompt on which speculation would
    not pay starts with the short pause whatever its length: agreement over a prompt the model did not
    write is a pessimistic estimate of agreement over its own greedy continuation (seed-407m: 0.59 over
    a random prompt, 1.0 while decoding), so it earns an early probe. On a workload whose drafts are
    always rejected (and were on the prompt) decoding starts plain and probes after 8 tokens, 64 more,
    128 more, and so on.

    Not adaptive: always `draft_ahead` tokens.
    """

    def __init__(
        self,
        cfg: ArchConfig,
        draft_loops: int,
        verify_loops: int,
        draft_ahead: int,
        adaptive: bool,
        device_type: str = "cpu",
    ):
        self.cfg = cfg
        self.extra_token_cost = EXTRA_TOKEN_COST_BY_DEVICE.get(device_type, EXTRA_TOKEN_COST)
        if device_type == "cuda" and cfg.d_model < CUDA_LARGE_D_MODEL:
            self.extra_token_cost = CUDA_SMALL_MODEL_EXTRA_TOKEN_COST
        self.draft_loops = draft_loops
        self.verify_loops = verify_loops
        self.adaptive = adaptive
        self.draft_ahead = draft_ahead
        self.k = 1 if adaptive else draft_ahead
        self.k_max = 2 * draft_ahead if adaptive else draft_ahead
        self._accepted = 0.0
        self._rejected = 0.0
        self._plain_left = 0
        self._pauses = 0  # consecutive unprofitable pauses so far (indexes the back-off lengths)
        self.probing = False  # the next round is a probe after a pause

    def prime(self, agreement: float, positions: int) -> None:
        """Start from the draft/verify agreement measured over `positions` prompt positions (weighted as
        at most PRIOR_POSITIONS tokens, so live rounds soon outweigh it). Where speculation would not pay,
        decoding starts plain for 8 steps, then probes (a failed probe pauses for 64); where it would, the
        first round drafts `draft_ahead` tokens instead of probing with one."""
        if not self.adaptive or positions <= 0:
            return
        n = min(float(positions), PRIOR_POSITIONS)
        self._accepted, self._rejected = agreement * n, (1.0 - agreement) * n
        if self.best_cost_per_token() <= self.plain_cost():
            self.k = self.draft_ahead
        else:
            self._plain_left = self.backoff_steps(0)
            self._pauses = 1

    def next_k(self, remaining: int) -> int:
        if remaining <= 1:
            return 0
        if self._plain_left > 0:
            self._plain_left -= 1
            if self._plain_left == 0:
                self.probing = True
            return 0
        k = 1 if self.probing else self.k
        return min(k, remaining - 1)

    @property
    def acceptance(self) -> float:
        """Estimated per-token acceptance probability (a Beta(1, 1) prior over decayed counts)."""
        return (self._accepted + 1.0) / (self._accepted + self._rejected + 2.0)

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        self._accepted = 0.8 * self._accepted + accepted
        self._rejected = 0.8 * self._rejected + (accepted < drafted)
        if accepted == drafted:
            self.k = min(2 * self.k, self.draft_ahead) if self.k < self.draft_ahead else min(self.k + 1, self.k_max)
        else:
            self.k = max(1, min(self.k - 1, accepted + 1))
        self.probing = False
        if self.best_cost_per_token() <= self.plain_cost():
            self._pauses = 0
        elif accepted < drafted:
            self._plain_left = self.backoff_steps(self._pauses)
            self._pauses += 1

    @staticmethod
    def backoff_steps(pauses: int) -> int:
        """Plain steps of the pause that follows `pauses` earlier consecutive pauses."""
        if pauses < len(BACKOFF_STEPS):
            return BACKOFF_STEPS[pauses]
        return min(BACKOFF_STEPS[-1] << (pauses - len(BACKOFF_STEPS) + 1), BACKOFF_CAP)

    def plain_cost(self) -> float:
        c = self.cfg
        return c.n_prelude + self.verify_loops * c.n_body + c.n_coda + STEP_OVERHEAD_LAYERS

    def round_cost(self, k: int) -> float:
        c, d = self.cfg, self.draft_loops
        draft = c.n_prelude + d * c.n_body + c.n_coda + STEP_OVERHEAD_LAYERS
        tokens = 1 + self.extra_token_cost * k
        verify = ((self.verify_loops - d) * c.n_body + c.n_coda) * tokens + STEP_OVERHEAD_LAYERS
        return (k + 1) * draft + verify

    def can_pay(self) -> bool:
        """Whether any draft length could beat plain decoding even if every draft were accepted (not on CUDA
        for small models, where each further verified token costs a full step)."""
        return any(self.round_cost(k) / (k + 1) < self.plain_cost() for k in range(1, self.k_max + 1))

    def expected_tokens(self, k: int) -> float:
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def best_cost_per_token(self) -> float:
        return min(self.round_cost(k) / self.expected_tokens(k) for k in range(1, self.k_max + 1))
