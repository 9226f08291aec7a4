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

Stop tokens end generation exactly where plain decoding would: a drafted stop token ends the draft (the
verifier then picks that position's token itself), and a committed stop token ends the stream (it is not
yielded). A depth schedule's warm-up steps are plain shallow steps (nothing to speculate at that depth);
speculation starts after them and stays exact, because drafts and verification read the warm-up
positions' filled slots just as plain full-depth steps do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tinyloop.cache.base import StepCache
from tinyloop.grammar.index import TokenIndex
from tinyloop.model.looped import Resume
from tinyloop.runtime.decode import Row, decode_row
from tinyloop.runtime.depth_schedule import DepthSchedule, fill_skipped_iterations
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import TokenPicker, draw, filtered_probs
from tinyloop.runtime.spec_accept import accept_draft, normalized
from tinyloop.runtime.spec_costs import LayerCosts, StepCosts
from tinyloop.runtime.spec_policy import DraftPolicy
from tinyloop.sampling import SamplingParams

# The adaptive policy's first estimate of the acceptance rate comes from the prefill of the prompt's last
# PREFILL_ESTIMATE_POSITIONS positions (the policy weighs it as at most that many tokens) when their logits
# (positions x vocabulary) stay within PREFILL_ESTIMATE_LOGITS values; else from a probe round.
PREFILL_ESTIMATE_POSITIONS = 8
PREFILL_ESTIMATE_LOGITS = 1 << 22


@dataclass
class SpeculativeStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_passes: int = 0
    spec_tokens: int = 0  # tokens committed by verify passes (accepted + corrections + bonuses)
    plain_steps: int = 0  # full-depth single steps taken instead of speculating (adaptive fall-back)
    warmup_steps: int = 0  # shallow single steps of a depth schedule's warm-up
    prompt_agreement: float | None = None  # draft/verify agreement over the prompt (adaptive policy's prior)
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
    prefill_estimate: bool = True  # False: the adaptive policy starts with a probe round (for measurement)


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
    stop_tokens: frozenset[int] = frozenset(),
    schedule: DepthSchedule | None = None,
    costs: StepCosts | None = None,
) -> Iterator[int]:
    """Yield up to max_tokens committed ids, distributed as plain decoding at spec.verify_loops (with the
    same grammar, stop tokens and depth schedule: see decode_rows). costs: what the steps cost, timed with
    its clock (default: see step_costs)."""
    stats = stats if stats is not None else SpeculativeStats()
    stats.prompt_tokens = int(prompt.numel())
    costs = costs if costs is not None else step_costs(engine, spec, params)
    policy = DraftPolicy(costs, spec.draft_ahead, spec.adaptive)
    if spec.adaptive and not policy.can_pay():
        # Plain decoding is the faster path on this device whatever the drafts: take it outright (on a GPU
        # with the host one step ahead) rather than paying for probe rounds that cannot win.
        picker = TokenPicker(params, grammar, stop_tokens)
        yield from _plain(engine, cache, Row(prompt, spec.verify_loops, max_tokens, picker, schedule), stats)
        return
    picker = TokenPicker(params, grammar, stop_tokens)
    t0 = time.perf_counter()
    try:
        yield from _rounds(engine, cache, prompt, max_tokens, spec, picker, stats, schedule, policy)
    except GeneratorExit:
        stats.stop_reason = stats.stop_reason or "closed"
        raise
    finally:
        stats.time_s = time.perf_counter() - t0
        stats.finished = picker.accepting()


def step_costs(engine: Engine, spec: SpecConfig, params: SamplingParams) -> StepCosts:
    """The costs a request's policy starts from: learned from its own steps on the CPU; the layer-pass prior
    alone on CUDA (its constants were measured there, and a plain step inside rounds waits for its token where
    plain decoding keeps the host a step ahead) and for seeded sampling (timing-driven choices would change which
    random draws make its tokens, and it must repeat)."""
    prior = LayerCosts.for_device(engine.cfg, spec.draft_loops, spec.verify_loops, engine.device.type)
    seeded_sampling = params.temperature > 0.0 and params.seed is not None
    return StepCosts(prior, learn=engine.device.type == "cpu" and not seeded_sampling)


def _plain(engine: Engine, cache: StepCache, row: Row, stats: SpeculativeStats) -> Iterator[int]:
    """Plain decoding of `row` (at the verify depth), reported through the speculative statistics."""
    plain = row.stats
    t0 = time.perf_counter()
    try:
        yield from decode_row(engine, cache, row)
    finally:
        stats.time_s = time.perf_counter() - t0
        stats.generated_tokens, stats.prefill_s = plain.generated_tokens, plain.prefill_s
        stats.plain_steps = max(plain.generated_tokens - 1, 0)
        stats.plain_s = plain.decode_s
        stats.stop_reason, stats.finished = plain.stop_reason or "closed", plain.finished


def _rounds(
    engine: Engine,
    cache: StepCache,
    prompt: torch.Tensor,
    max_tokens: int,
    spec: SpecConfig,
    picker: TokenPicker,
    stats: SpeculativeStats,
    schedule: DepthSchedule | None,
    policy: DraftPolicy,
) -> Iterator[int]:
    if max_tokens == 0 or picker.done():
        stats.stop_reason = "max_tokens" if max_tokens == 0 else "grammar_end"
        return
    t = time.perf_counter()
    cache.truncate(0)
    ids = prompt.to(torch.long).view(1, -1)
    split = min(ids.shape[1], PREFILL_ESTIMATE_POSITIONS)
    if spec.adaptive and spec.prefill_estimate and split * engine.cfg.vocab_size <= PREFILL_ESTIMATE_LOGITS:
        if split < ids.shape[1]:
            engine.step(ids[:, :-split], cache, spec.verify_loops, last_only=True)
        last, agreement = _split_prefill(engine, cache, ids[:, -split:], spec, picker.params)
        policy.prime(agreement, split)
        stats.prompt_agreement = agreement
    else:
        logits = engine.step(ids, cache, spec.verify_loops, last_only=True).logits
        assert logits is not None
        last = logits[0, -1]
    first = picker.pick(last)
    stats.prefill_s = time.perf_counter() - t
    if first is None:
        stats.stop_reason = "stop_token"
        return
    pending = first
    stats.generated_tokens = 1
    yield pending
    warmup = schedule.warmup_tokens if schedule is not None else 0
    while stats.generated_tokens < max_tokens:
        if picker.done():
            stats.stop_reason = "grammar_end"
            return
        step = stats.generated_tokens  # the decode step that would produce the next token (1-based)
        stopped = False
        if schedule is not None and step <= warmup:
            t = time.perf_counter()
            token = _plain_step(engine, cache, pending, schedule.loops_for(step, spec.verify_loops), spec, picker)
            stats.plain_s += time.perf_counter() - t
            stats.warmup_steps += 1
            new, stopped = ([], True) if token is None else ([token], False)
        elif (k := policy.next_k(max_tokens - stats.generated_tokens)) == 0:
            t = policy.costs.clock()
            token = _plain_step(engine, cache, pending, spec.verify_loops, spec, picker)
            spent = policy.costs.clock() - t
            policy.costs.add_plain(spent)
            stats.plain_s += spent
            stats.plain_steps += 1
            new, stopped = ([], True) if token is None else ([token], False)
        else:
            new, stopped = _speculate(engine, cache, pending, k, spec, picker, stats, policy)
        for token in new:
            stats.generated_tokens += 1
            yield token
        if stopped:
            stats.stop_reason = "stop_token"
            return
        if not new:  # the grammar ended inside the round
            stats.stop_reason = "grammar_end"
            return
        pending = new[-1]
    stats.stop_reason = "max_tokens"


def _split_prefill(
    engine: Engine, cache: StepCache, ids: torch.Tensor, spec: SpecConfig, params: SamplingParams
) -> tuple[torch.Tensor, float]:
    """The prefill of `ids` (after what the cache holds) in two passes, draft_loops then the rest resumed
    from the drafted state (the cache ends as after a plain prefill, exactly as verification leaves it),
    giving both depths' predictions at these positions for a coda and head pass more. Returns the last
    position's logits at verify depth and how often the two depths agree there: the rate at which drafts
    would be accepted (greedy: same argmax; sampling: the overlap sum(min(p, q)) of the tempered
    distributions)."""
    start = cache.lengths.clone()
    draft = engine.step(ids, cache, spec.draft_loops)
    assert draft.logits is not None
    full = engine.step(ids, cache, spec.verify_loops, start=start, resume=draft.resume_at(spec.draft_loops)).logits
    assert full is not None
    q, p = draft.logits[0].float(), full[0].float()
    if params.temperature == 0.0:
        agreement = float((q.argmax(-1) == p.argmax(-1)).float().mean())
    else:
        pq = torch.minimum(torch.softmax(p / params.temperature, -1), torch.softmax(q / params.temperature, -1))
        agreement = float(pq.sum(-1).mean())
    return full[0, -1], agreement


def _plain_step(
    engine: Engine, cache: StepCache, pending: int, loops: int, spec: SpecConfig, picker: TokenPicker
) -> int | None:
    """One single-token step at `loops` (shallower than verify_loops: a warm-up step, whose skipped
    iterations are filled as DepthSchedule says); None when a stop token was picked."""
    logits = engine.step(torch.tensor([[pending]]), cache, loops, last_only=True).logits
    assert logits is not None
    if loops < spec.verify_loops:
        end = int(cache.lengths[0])
        fill_skipped_iterations(cache, loops, spec.verify_loops, end - 1, end)
    return picker.pick(logits[0, -1])


def _speculate(
    engine: Engine,
    cache: StepCache,
    pending: int,
    k: int,
    spec: SpecConfig,
    picker: TokenPicker,
    stats: SpeculativeStats,
    policy: DraftPolicy,
) -> tuple[list[int], bool]:
    """One draft + verify round: the committed tokens (accepted drafts, then the correction or bonus), and
    whether a stop token was picked after them (it is not among the committed tokens)."""
    p = picker.params
    greedy = p.temperature == 0.0
    start = int(cache.lengths[0])
    costs = policy.costs
    t = costs.clock()
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
        q = None if greedy else normalized(filtered_probs(logits, p.temperature, p.top_k, p.top_p))
        x = int(torch.argmax(logits)) if q is None else draw(q, picker.gen)
        if x in picker.stop_tokens:  # the verifier decides this position's token itself
            break
        if q is not None:
            draft_probs.append(q)
        drafts.append(x)
        g_states.append(picker.grammar.advance(g_states[-1], x) if picker.grammar is not None else 0)
    draft_s = costs.clock() - t
    stats.draft_s += draft_s

    t = costs.clock()
    inputs = torch.tensor([[pending, *drafts]])
    first = torch.tensor([start])
    if spec.resume_verify:
        resume = Resume(torch.cat(states, dim=1), torch.cat(preludes, dim=1), spec.draft_loops)
        out = engine.step(inputs, cache, spec.verify_loops, start=first, resume=resume)
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
            extra = draw(pv, picker.gen)
    # Positions start..start+n_ok hold verified K/V (pending and the accepted drafts); drop the rest.
    cache.truncate(start + n_ok + 1)
    picker.state = state
    stopped = extra is not None and extra in picker.stop_tokens
    if extra is not None and not stopped:
        committed.append(extra)
        if picker.grammar is not None:
            picker.state = picker.grammar.advance(state, extra)
    verify_s = costs.clock() - t
    costs.add_round(len(states), draft_s, len(drafts) + 1, verify_s)
    stats.verify_s += verify_s
    stats.verify_passes += 1
    stats.drafted += len(drafts)
    stats.accepted += n_ok
    stats.spec_tokens += len(committed)
    policy.update(len(drafts), n_ok)
    return committed, stopped
