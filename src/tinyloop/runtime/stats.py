"""What a generation request reports about itself."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of its logits, before temperature,
    top-k/top-p and grammar masks) and the `top` most likely (token, log-probability) pairs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # Why generation ended: max_tokens, stop_token, stop_string, grammar_end (nothing else can follow),
    # or closed (the caller stopped iterating). finished is False when a grammar was still in a
    # non-accepting state at the end: the text is then only a prefix of a match.
    stop_reason: str = ""
    finished: bool = True
    # One entry per generated token when the request asked for logprobs (SamplingParams.logprobs).
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from the prefill; each later one costs a decode step.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0
