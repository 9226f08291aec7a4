"""Adaptive draft length for self-speculative decoding, with a fall-back to plain decoding."""

from __future__ import annotations

from tinyloop.runtime.spec_costs import StepCosts

# Plain steps between probe rounds while speculation does not pay: a short first pause (one unlucky round
# on a good workload costs little), then long ones that double up to the cap.
BACKOFF_STEPS = (8, 64)
BACKOFF_CAP = 512
# The most prompt positions the prefill's agreement estimate counts as (see prime).
PRIOR_POSITIONS = 8.0
# Weight of the previous rounds in the acceptance counts, per round.
DECAY = 0.8
# The same for speculation's realized cost per token: acceptances come in runs (long accepted rounds pay for
# the failed ones between them), so it is judged over more rounds, starting from PRIOR_ROUNDS rounds of
# `draft_ahead` drafts with the prompt's agreement.
ROUND_DECAY = 0.9
PRIOR_ROUNDS = 4.0


class DraftPolicy:
    """Chooses how many tokens to draft next (0: take a plain full-depth step instead).

    Adaptive: speculation runs while it costs less per token than plain decoding, by `costs` (seconds
    measured on this machine; a layer-pass prior for a ratio not measured yet). While learning, a plain step
    every 8 rounds times plain decoding against them (no slower than plain).
    The prefill measures how often the draft and verify depths agree over the prompt (prime): where the
    best draft length's expected cost per token (from that agreement) beats a plain step, the first round
    drafts `draft_ahead` tokens; without the estimate it drafts one (the cheapest probe).
    The draft length doubles after each fully accepted round up to `draft_ahead`, then grows by one up to
    2 x draft_ahead, and shrinks to one past the accepted count after a rejection; the next round drafts
    the length nearest that one whose round would cost less than as many plain steps if fully accepted.
    Speculation goes on after a fully accepted round while such a length exists, after a rejection while
    also its cost per committed token over the recent rounds (decayed, starting from the prompt's agreement;
    each round at the current cost of its length) is below a plain step's: acceptances come in runs, so this
    realized rate predicts the next rounds better than a per-token acceptance rate would. Otherwise it
    pauses for plain steps (8, then 64, doubling up to 512 while it stays unprofitable) and then probes with
    the shortest draft that could pay, which also re-times the draft and verify steps; a round after which
    speculation goes on resets the pauses to 8. A prompt on which speculation would not pay starts with the
    short pause whatever its length: agreement over a prompt the model did not write is a pessimistic
    estimate of agreement over its own greedy continuation (seed-407m: 0.59 over a random prompt, 1.0 while
    decoding), so it earns an early probe. Where drafts are always rejected, or verify passes cost too much,
    decoding runs plain and probes after 8 tokens, 64 more, 128 more, and so on.

    Not adaptive: always `draft_ahead` tokens.
    """

    def __init__(self, costs: StepCosts, draft_ahead: int, adaptive: bool):
        self.costs = costs
        self.adaptive = adaptive
        self.draft_ahead = draft_ahead
        self.k = 1 if adaptive else draft_ahead
        self.k_max = 2 * draft_ahead if adaptive else draft_ahead
        self._accepted = 0.0
        self._rejected = 0.0
        self._rounds: dict[int, float] = {}  # decayed counts of recent rounds by draft length
        self._round_tokens = 0.0  # and of the tokens they committed
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
        self._rounds = {self.draft_ahead: PRIOR_ROUNDS}
        self._round_tokens = PRIOR_ROUNDS * self.expected_tokens(self.draft_ahead)
        if self.best_cost_per_token() <= self.costs.plain():
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
        if self.adaptive and self.costs.wants_plain_sample():
            return 0
        k = self.probe_length() if self.probing else self.k
        return min(k, remaining - 1)

    @property
    def acceptance(self) -> float:
        """Estimated per-token acceptance probability (a Beta(1, 1) prior over decayed counts)."""
        return (self._accepted + 1.0) / (self._accepted + self._rejected + 2.0)

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        self._accepted = DECAY * self._accepted + accepted
        self._rejected = DECAY * self._rejected + (accepted < drafted)
        self._rounds = {k: ROUND_DECAY * n for k, n in self._rounds.items()}
        self._rounds[drafted] = self._rounds.get(drafted, 0.0) + 1.0
        self._round_tokens = ROUND_DECAY * self._round_tokens + accepted + 1
        if accepted == drafted:
            self.k = min(2 * self.k, self.draft_ahead) if self.k < self.draft_ahead else min(self.k + 1, self.k_max)
        else:
            self.k = max(1, min(self.k - 1, accepted + 1))
        self.probing = False
        nearest = self.paying_length(self.k)
        pays = nearest is not None and (accepted == drafted or self.cost_per_token() < self.costs.plain())
        if nearest is not None and pays:
            self.k = nearest
            self._pauses = 0
        else:
            self._plain_left = self.backoff_steps(self._pauses)
            self._pauses += 1

    @staticmethod
    def backoff_steps(pauses: int) -> int:
        """Plain steps of the pause that follows `pauses` earlier consecutive pauses."""
        if pauses < len(BACKOFF_STEPS):
            return BACKOFF_STEPS[pauses]
        return min(BACKOFF_STEPS[-1] << (pauses - len(BACKOFF_STEPS) + 1), BACKOFF_CAP)

    def cost_per_token(self) -> float:
        """Speculation's cost per committed token over the recent rounds (decayed), at the current step costs."""
        if not self._round_tokens:
            return float("inf")
        return sum(n * self.costs.round(k) for k, n in self._rounds.items()) / self._round_tokens

    def paying_length(self, k: int) -> int | None:
        """The draft length nearest k (the shorter on a tie) whose round would pay if fully accepted."""
        paying = [j for j in range(1, self.k_max + 1) if self.round_pays(j)]
        return min(paying, key=lambda j: (abs(j - k), j)) if paying else None

    def probe_length(self) -> int:
        """A probe drafts the fewest tokens that could pay (a verify pass with a high fixed cost pays only
        over long rounds), or one to re-time the steps when none could."""
        return next((j for j in range(1, self.k_max + 1) if self.round_pays(j)), 1)

    def round_pays(self, k: int) -> bool:
        """Whether a round drafting k tokens, all accepted, costs less than the k + 1 plain steps it replaces."""
        return self.costs.round(k) < (k + 1) * self.costs.plain()

    def can_pay(self) -> bool:
        """Whether, by the layer-pass prior, any draft length could beat plain decoding even if every draft
        were accepted (not on CUDA for small models, where each further verified token costs a full step)."""
        prior = self.costs.prior
        return any(
            (k + 1) * prior.draft() + prior.verify(k + 1) < (k + 1) * prior.plain() for k in range(1, self.k_max + 1)
        )

    def expected_tokens(self, k: int) -> float:
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def best_cost_per_token(self) -> float:
        return min(self.costs.round(k) / self.expected_tokens(k) for k in range(1, self.k_max + 1))
