"""Next-token sampling: greedy, temperature, top-k, top-p (pure functions of logits), and a request's
picker that applies its grammar and stop tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tinyloop.errors import NonFiniteLogitsError
from tinyloop.grammar.index import TokenIndex
from tinyloop.runtime.stats import TokenLogprob
from tinyloop.sampling import SamplingParams


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """One token id from logits [V]. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.

    Raises NonFiniteLogitsError on NaN or inf logits (a forbidden token's -inf is fine)."""
    if temperature == 0.0:
        return checked_argmax(logits.view(1, -1))[0]
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise NonFiniteLogitsError()
    return draw(filtered_probs(logits, temperature, top_k, top_p), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution probs [V] (`drawn_tokens`) with one uniform of `generator`."""
    return int(drawn_tokens(probs.view(1, -1), uniform_draw(generator).view(1))[0])


def uniform_draw(generator: torch.Generator | None) -> torch.Tensor:
    """The one uniform number in [0, 1) (float64, on the CPU) that a sampled token costs its generator."""
    return torch.rand((), dtype=torch.float64, generator=generator)


def drawn_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token from its distribution probs [B, V] (float64, not necessarily normalised) and one uniform
    in [0, 1) per row [B] (any device): the first token whose cumulative probability exceeds u times the total,
    computed where the probabilities are. Never a zero-probability token: the point stays below the total."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    point = torch.minimum(uniforms.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(-1)


def argmax_or_flag(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of logits [B, V], or -1 where the row holds NaN or +inf (a forbidden token's -inf is
    fine), computed where the logits are: one readback serves a whole batch."""
    return argmax_and_flagged(logits)[1]


def argmax_and_flagged(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's argmax of logits [B, V], the same as `argmax_or_flag`) from one reduction (its maximum is
    NaN where the row holds one, +inf where it holds that); the first ids of equal maxima, as argmax."""
    top, tokens = torch.max(logits, -1)
    return tokens, torch.where(top < math.inf, tokens, -1)


def checked_argmax(logits: torch.Tensor) -> list[int]:
    """Greedy tokens of logits [B, V] (`argmax_or_flag`, read back once); NonFiniteLogitsError if any row is
    non-finite."""
    tokens = argmax_or_flag(logits).tolist()
    if min(tokens) < 0:
        raise NonFiniteLogitsError()
    return tokens


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under logits [V] and the `top` most likely tokens (ties: lower id first)."""
    logp = torch.log_softmax(logits.double().cpu(), dim=-1)
    pairs: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        pairs = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), pairs)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution `sample_next` draws from (temperature > 0): float64 [V] on the CPU."""
    return filtered_probs_rows(logits.view(1, -1).cpu(), [(temperature, top_k, top_p)])[0]


def filtered_probs_rows(logits: torch.Tensor, settings: Sequence[tuple[float, int, float]]) -> torch.Tensor:
    """Each row's sampling distribution, float64 [B, V] where the logits [B, V] are, under its (temperature > 0,
    top_k, top_p): a GPU batch filters all its sampled rows in a few launches and one transfer."""
    dev = logits.device
    scores = logits.double() / torch.tensor([t for t, _, _ in settings], dtype=torch.float64, device=dev)[:, None]
    vocab = scores.shape[-1]
    ks = [k if 0 < k < vocab else 0 for _, k, _ in settings]
    if any(ks):
        top = torch.topk(scores, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k - 1, 0) for k in ks], device=dev)[:, None])
        unfiltered = torch.tensor([k == 0 for k in ks], device=dev)[:, None]
        scores = scores.masked_fill(~unfiltered & (scores < kth), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    nucleus = [b for b, (_, _, p) in enumerate(settings) if p < 1.0]
    if nucleus:
        rows = torch.tensor(nucleus, device=dev)
        top_p = torch.tensor([settings[b][2] for b in nucleus], dtype=torch.float64, device=dev)[:, None]
        sorted_probs, order = torch.sort(probs[rows], descending=True, dim=-1)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs[rows] = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs


class TokenPicker:
    """Samples next tokens under a grammar and stop tokens, and tracks the grammar state."""

    def __init__(self, params: SamplingParams, grammar: TokenIndex | None, stop_tokens: frozenset[int]) -> None:
        self.params = params
        self.gen = params.generator()
        self.grammar = grammar
        self.stop_tokens = stop_tokens
        self.state = grammar.initial if grammar is not None else 0
        self._stop_mask: torch.Tensor | None = None
        if grammar is not None and stop_tokens:
            self._stop_mask = torch.zeros(grammar.vocab_size, dtype=torch.bool, device=grammar.device)
            self._stop_mask[[t for t in stop_tokens if t < grammar.vocab_size]] = True

    def done(self, state: int | None = None) -> bool:
        return self.grammar is not None and self.grammar.is_done(self.state if state is None else state)

    def accepting(self) -> bool:
        return self.grammar is None or self.grammar.is_final(self.state)

    def constrain(self, logits: torch.Tensor, state: int | None = None) -> torch.Tensor:
        """Logits with every token the grammar forbids in `state` (default: the current one) at -inf."""
        if self.grammar is None:
            return logits
        state = self.state if state is None else state
        if self._stop_mask is not None and self.grammar.is_final(state):
            forbidden = ~(self.grammar.allowed(state) | self._stop_mask)
        else:
            forbidden = self.grammar.forbidden(state)
        return logits.masked_fill(forbidden.to(logits.device), float("-inf"))

    @property
    def plain_greedy(self) -> bool:
        """Greedy without a grammar: its token is the logits' argmax, which a batch can take for all such rows
        at once (`argmax_or_flag`) and hand to `pick`."""
        return self.grammar is None and self.params.temperature == 0.0

    @property
    def plain_sampled(self) -> bool:
        """Sampled without a grammar: its distribution (`filtered_probs_rows`) and its draw (`drawn_tokens`, from
        the uniform it takes from its generator) can be computed with a batch's and handed to `pick`."""
        return self.grammar is None and self.params.temperature > 0.0

    def uniform(self) -> torch.Tensor:
        """The uniform its next sampled token is drawn with, taken from its generator as `pick` alone would."""
        return uniform_draw(self.gen)

    def pick(self, logits: torch.Tensor, prepared: int | None = None) -> int | None:
        """The next token, or None when a stop token was sampled. prepared: what a batch computed for a plain
        picker (decode.prepared_picks): the argmax of a greedy one, the token a sampled one drew with its own
        uniform (`uniform_draw`), or -1 where the logits were non-finite."""
        p = self.params
        if isinstance(prepared, int) and (self.plain_greedy or self.plain_sampled):
            return self.take(prepared)
        return self.take(sample_next(self.constrain(logits), p.temperature, p.top_k, p.top_p, self.gen))

    def take(self, token: int) -> int | None:
        """`token` as the next one (a plain-greedy argmax computed with a batch's or on the device; -1: the
        logits were non-finite), or None for a stop token."""
        if token < 0:
            raise NonFiniteLogitsError()
        if token in self.stop_tokens:
            return None
        if self.grammar is not None:
            self.state = self.grammar.advance(self.state, token)
        return token
