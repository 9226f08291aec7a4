"""Self-speculative decoding: the same weights draft with few loops and verify with many.

A round at cache length P with pending token x (sampled, not yet in the cache):
1. Draft: k+1 single-token steps at draft_loops over x, d1..dk (positions P..P+k), sampling d1..dk and
   keeping each position's loop state after draft_loops iterations and its prelude output.
2. Verify: ONE step over those k+1 positions, resumed from the drafted states at iteration draft_loops
   (iterations 0..draft_loops-1 are the same computation in both: they read only iterations < draft_loops
   of earlier positions, which hold verified values). It rewrites the body slots of iterations
   >= draft_loops and the coda slots at these positions, replacing the draft's shallow coda K/V, so every
   later token attends to exactly what plain full-depth decoding would have stored.
3. Accept (greedy match or rejection sampling), add the correction or bonus token, and truncate the cache
   to the verified positions (exact rollback: entries past `lengths` are never read).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tinyloop.cache.base import StepCache
from tinyloop.grammar.index import TokenIndex
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.generate import SamplingParams, TokenPicker
from tinyloop.runtime.sampling import filtered_probs
from tinyloop.runtime.spec_accept import accept_draft, normalized
from tinyloop.runtime.spec_policy import DraftPolicy


@dataclass
class SpeculativeStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_passes: int = 0
    spec_tokens: int = 0  # tokens committed by verify passes (accepted + corrections + bonuses)
    plain_steps: int = 0  # full-depth single steps taken instead of speculating (adaptive fall-back)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    plain_s: float = 0.0
    time_s: float = 0.0
    stop_reason: str = ""
    finished: bool = True

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.spec_tokens / self.verify_passes if self.verify_passes else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = self.time_s - self.prefill_s
        return (self.generated_tokens - 1) / decode_s if decode_s > 0 and self.generated_tokens > 1 else 0.0


@dataclass(frozen=True)
class SpecConfig:
    draft_loops: int
    verify_loops: int
    draft_ahead: int
    adaptive: bool = True
    resume_verify: bool = True  # False recomputes drafted positions from scratch (for measurement)


def speculative_tokens(
    engine: Engine,
    cache: StepCache,
    prompt: torch.Tensor,
    max_tokens: int,
    spec: SpecConfig,
    params: SamplingParams,
    stats: SpeculativeStats | None = None,
    *,
    grammar: TokenIndex | None = None,
) -> Iterator[int]:
    """Yield up to max_tokens committed ids, distributed as plain decoding at spec.verify_loops."""
    stats = stats if stats is not None else SpeculativeStats()
    stats.prompt_tokens = int(prompt.numel())
    picker = TokenPicker(params, grammar, frozenset())
    t0 = time.perf_counter()
    try:
        yield from _rounds(engine, cache, prompt, max_tokens, spec, picker, stats)
    except GeneratorExit:
        stats.stop_reason = stats.stop_reason or "closed"
        raise
    finally:
        stats.time_s = time.perf_counter() - t0
        stats.finished = picker.accepting()


def _rounds(
    engine: Engine,
    cache: StepCache,
    prompt: torch.Tensor,
    max_tokens: int,
    spec: SpecConfig,
    picker: TokenPicker,
    stats: SpeculativeStats,
) -> Iterator[int]:
    if max_tokens == 0 or picker.done():
        stats.stop_reason = "max_tokens" if max_tokens == 0 else "grammar_end"
        return
    t = time.perf_counter()
    cache.truncate(0)
    logits = engine.step(prompt.to(torch.long).view(1, -1), cache, spec.verify_loops, last_only=True).logits
    assert logits is not None
    pending = picker.pick(logits[0, -1])
    assert pending is not None
    stats.prefill_s = time.perf_counter() - t
    stats.generated_tokens = 1
    yield pending
    policy = DraftPolicy(engine.cfg, spec.draft_loops, spec.verify_loops, spec.draft_ahead, spec.adaptive)
    while stats.generated_tokens < max_tokens:
        if picker.done():
            stats.stop_reason = "grammar_end"
            return
        k = policy.next_k(max_tokens - stats.generated_tokens)
        if k == 0:
            t = time.perf_counter()
            logits = engine.step(torch.tensor([[pending]]), cache, spec.verify_loops, last_only=True).logits
            assert logits is not None
            token = picker.pick(logits[0, -1])
            assert token is not None
            stats.plain_s += time.perf_counter() - t
            stats.plain_steps += 1
            new = [token]
        else:
            new = _speculate(engine, cache, pending, k, spec, picker, stats, policy)
        for token in new:
            stats.generated_tokens += 1
            yield token
        if not new:  # the grammar ended inside the round
            stats.stop_reason = "grammar_end"
            return
        pending = new[-1]
    stats.stop_reason = "max_tokens"


def _speculate(
    engine: Engine,
    cache: StepCache,
    pending: int,
    k: int,
    spec: SpecConfig,
    picker: TokenPicker,
    stats: SpeculativeStats,
    policy: DraftPolicy,
) -> list[int]:
    """One draft + verify round; returns the committed tokens (accepted drafts, then the correction or bonus)."""
    p = picker.params
    greedy = p.temperature == 0.0
    start = int(cache.lengths[0])
    t = time.perf_counter()
    states: list[torch.Tensor] = []
    preludes: list[torch.Tensor] = []
    drafts: list[int] = []
    draft_probs: list[torch.Tensor] = []
    g_states = [picker.state]  # grammar state before each drafted token, then after the last
    x = pending
    for i in range(k + 1):
        out = engine.step(torch.tensor([[x]]), cache, spec.draft_loops, last_only=True)
        assert out.loop_state is not None and out.prelude_out is not None and out.logits is not None
        states.append(out.loop_state)
        preludes.append(out.prelude_out)
        if i == k or picker.done(g_states[-1]):
            break
        logits = picker.constrain(out.logits[0, -1], g_states[-1])
        if greedy:
            x = int(torch.argmax(logits))
        else:
            q = normalized(filtered_probs(logits, p.temperature, p.top_k, p.top_p))
            x = int(torch.multinomial(q, 1, generator=picker.gen))
            draft_probs.append(q)
        drafts.append(x)
        g_states.append(picker.grammar.advance(g_states[-1], x) if picker.grammar is not None else 0)
    stats.draft_s += time.perf_counter() - t

    t = time.perf_counter()
    inputs = torch.tensor([[pending, *drafts]])
    first = torch.tensor([start])
    if spec.resume_verify:
        resume = (torch.cat(states, dim=1), torch.cat(preludes, dim=1))
        out = engine.step(
            inputs, cache, spec.verify_loops, start=first, resume=resume, start_loop=spec.draft_loops
        )  # fmt: skip
    else:
        out = engine.step(inputs, cache, spec.verify_loops, start=first)
    assert out.logits is not None
    verify_logits = out.logits[0]  # [len(drafts) + 1, V]: row i predicts the token after input i

    committed: list[int] = []
    extra: int | None = None
    for i, d in enumerate(drafts):
        logits = picker.constrain(verify_logits[i], g_states[i])
        if greedy:
            v = int(torch.argmax(logits))
            ok, extra = (True, None) if v == d else (False, v)
        else:
            pv = normalized(filtered_probs(logits, p.temperature, p.top_k, p.top_p))
            ok, extra = accept_draft(pv, draft_probs[i], d, picker.gen)
        if not ok:
            break
        committed.append(d)
    n_ok = len(committed)
    state = g_states[n_ok]
    if extra is None and not picker.done(state):  # every draft accepted: the bonus token
        logits = picker.constrain(verify_logits[n_ok], state)
        if greedy:
            extra = int(torch.argmax(logits))
        else:
            pv = normalized(filtered_probs(logits, p.temperature, p.top_k, p.top_p))
            extra = int(torch.multinomial(pv, 1, generator=picker.gen))
    # Positions start..start+n_ok hold verified K/V (pending and the accepted drafts); drop the rest.
    cache.truncate(start + n_ok + 1)
    picker.state = state
    if extra is not None:
        committed.append(extra)
        if picker.grammar is not None:
            picker.state = picker.grammar.advance(state, extra)
    stats.verify_s += time.perf_counter() - t
    stats.verify_passes += 1
    stats.drafted += len(drafts)
    stats.accepted += n_ok
    stats.spec_tokens += len(committed)
    policy.update(len(drafts), n_ok)
    return committed
