"""Adaptive draft length for self-speculative decoding, with a fall-back to plain decoding."""

from __future__ import annotations

from tinyloop.config import ArchConfig

# A step's fixed work (embedding, head, sampling, launch) in units of one layer pass, and the extra cost
# of each further token in a multi-token step relative to the first. Fixed constants keep the policy
# deterministic, so a seeded run repeats exactly.
STEP_OVERHEAD_LAYERS = 2.0
EXTRA_TOKEN_COST = 0.15


class DraftPolicy:
    """Chooses how many tokens to draft next (0: take a plain full-depth step instead).

    The draft length grows by one after a fully accepted round and shrinks after a rejection. The
    per-token acceptance rate is tracked (decayed counts); when a layer-pass cost model says that even the
    best draft length would cost more per token than plain decoding, speculation pauses for a back-off
    of plain steps (8, doubling up to 128 while it stays unprofitable) and then probes again.
    """

    def __init__(self, cfg: ArchConfig, draft_loops: int, verify_loops: int, draft_ahead: int, adaptive: bool):
        self.cfg = cfg
        self.draft_loops = draft_loops
        self.verify_loops = verify_loops
        self.adaptive = adaptive
        self.k = draft_ahead
        self.k_max = 2 * draft_ahead if adaptive else draft_ahead
        self._accepted = 0.0
        self._rejected = 0.0
        self._plain_left = 0
        self._backoff = 8

    def next_k(self, remaining: int) -> int:
        if remaining <= 1:
            return 0
        if self._plain_left > 0:
            self._plain_left -= 1
            return 0
        return min(self.k, remaining - 1)

    @property
    def acceptance(self) -> float:
        """Estimated per-token acceptance probability (a Beta(1, 1) prior over decayed counts)."""
        return (self._accepted + 1.0) / (self._accepted + self._rejected + 2.0)

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        self._accepted = 0.8 * self._accepted + accepted
        self._rejected = 0.8 * self._rejected + (accepted < drafted)
        self.k = min(self.k + 1, self.k_max) if accepted == drafted else max(1, min(self.k - 1, accepted + 1))
        if self.best_cost_per_token() > self.plain_cost():
            self._plain_left = self._backoff
            self._backoff = min(2 * self._backoff, 128)
        else:
            self._backoff = 8

    def plain_cost(self) -> float:
        c = self.cfg
        return c.n_prelude + self.verify_loops * c.n_body + c.n_coda + STEP_OVERHEAD_LAYERS

    def round_cost(self, k: int) -> float:
        c, d = self.cfg, self.draft_loops
        draft = c.n_prelude + d * c.n_body + c.n_coda + STEP_OVERHEAD_LAYERS
        verify = ((self.verify_loops - d) * c.n_body + c.n_coda) * (1 + EXTRA_TOKEN_COST * k) + STEP_OVERHEAD_LAYERS
        return (k + 1) * draft + verify

    def expected_tokens(self, k: int) -> float:
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def best_cost_per_token(self) -> float:
        return min(self.round_cost(k) / self.expected_tokens(k) for k in range(1, self.k_max + 1))
