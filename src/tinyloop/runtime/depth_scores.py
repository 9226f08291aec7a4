"""Log-probabilities of a sequence's own next tokens at several depths from one forward (evaluation).

The deepest depth runs once; each shallower depth re-applies only the exit path (coda, final norm, head)
to that iteration's state, which is exactly what a separate run at that depth computes (the loop's first
iterations do not depend on how many follow). Only per-token values are kept, never [L, T, V] logits.

With an exit criterion every loop still runs for every position; a position reads the logits of the
first depth whose check fires (Huginn's criteria, Ouro's gate CDF), as `ExitCriterion` defines them for
decoding, and at most the asked depth.

`continuation_logprobs` scores continuations after shared contexts: each context runs once, and its
continuations continue from copies of its cache rows (the same values, up to the rounding of attention over
a cache). Every depth of a sweep reads there too: the context's coda K/V at each shallower depth are kept
in a cache of their own, for that depth's coda of the continuations to attend to.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyloop.cache.kv import KVCache
from tinyloop.model.layers import StepContext
from tinyloop.model.looped import exit_hidden, head, initial_state
from tinyloop.runtime.adaptive_exit import ExitCriterion
from tinyloop.runtime.engine import Engine, cpu_threads_for


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
    cfg = engine.cfg
    deepest = depths[-1]
    targets = tokens[:, 1:].long()
    if criterion is None and len(depths) == 1:
        out = engine.step(tokens, None, deepest)
        assert out.logits is not None
        lp, greedy = _target_scores(out.logits[:, :-1], targets)
        return DepthLogprobs(depths, lp[None], greedy[None], torch.full_like(lp, deepest, dtype=torch.long)[None])
    out = engine.step(tokens, None, deepest, collect_states=True)
    final, states = out.logits, out.states
    assert final is not None and states is not None
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device)[None].expand(B, T)
    ctx = engine.context(positions, None, None)

    def at_depth(depth: int) -> _DepthView:
        state = states[1 + depth]
        logits = final if depth == deepest else _exit_logits(engine, state, ctx)
        gate = out.gates[depth - 1][:, :-1] if out.gates else None
        return _DepthView(logits[:, :-1], state[:, :-1], gate)

    start = initial_state(cfg, states[1], positions, engine.noise)[:, :-1]
    return _read_depths(depths, criterion, cfg.vocab_size, start, targets, at_depth)


@torch.inference_mode()
def continuation_logprobs(
    engine: Engine,
    contexts: list[torch.Tensor],
    continuations: list[torch.Tensor],
    owner: torch.Tensor,
    depths: tuple[int, ...],
    criterion: ExitCriterion | None = None,
) -> DepthLogprobs:
    """Continuation r (1-D, n_r >= 1 tokens) after context owner[r] (1-D, >= 1 token): the contexts run once,
    each continuation from a copy of its context's cache rows. Results [D, R, N] (N = the longest
    continuation; row r's first n_r entries): entry t scores continuation[t] given context + continuation[:t],
    as `depth_logprobs` on context + continuation scores those positions (up to the rounding of attending
    over a cache). The positions run are max context + N - 1, which must fit the engine's max_positions."""
    cfg = engine.cfg
    deepest = depths[-1]
    needed = set(depths) if criterion is None else set(range(1, deepest + 1))
    m = torch.tensor([len(c) for c in contexts])
    n = torch.tensor([len(c) for c in continuations])
    span = int(m.max()) + int(n.max()) - 1  # positions any row may run, its padding included
    context_ids = _right_padded(contexts, int(m.max()), engine.device)
    cache = engine.new_cache(len(contexts), span, deepest)
    ctx_out = engine.step(context_ids, cache, deepest, valid=m, last_only=True, collect_states=True)
    assert ctx_out.logits is not None and ctx_out.states is not None
    Bc, Tc = context_ids.shape
    ctx_positions = torch.arange(Tc, device=engine.device)[None].expand(Bc, Tc)
    last = (m - 1).to(engine.device)
    rows = owner.to(engine.device)

    def at_last(x: torch.Tensor) -> torch.Tensor:  # [Bc, Tc, ...] -> each context's last position [Bc, 1, ...]
        return x[torch.arange(Bc, device=engine.device), last][:, None]

    # Per depth: the context's last position (logits, state, gate) for each continuation and, below the
    # deepest, the context's coda K/V at that depth.
    first: dict[int, _DepthView] = {}
    coda_caches: dict[int, KVCache] = {}
    for depth in sorted(needed):
        state = ctx_out.states[1 + depth]
        if depth == deepest:
            logits = ctx_out.logits
        else:
            coda_cache = KVCache(cfg, Bc, span, 0, engine.device, engine.dtype)  # prelude and coda slots
            ctx = engine.context(ctx_positions, coda_cache, None)
            logits = _exit_logits(engine, state, ctx, at_last)
            coda_caches[depth] = coda_cache.select_rows(owner)
        gate = at_last(ctx_out.gates[depth - 1])[rows] if ctx_out.gates else None
        first[depth] = _DepthView(logits[rows], at_last(state)[rows], gate)
    start = at_last(initial_state(cfg, ctx_out.states[1], ctx_positions, engine.noise))[rows]
    targets = _right_padded(continuations, int(n.max()), engine.device)
    if int(n.max()) == 1:  # every continuation is one token: the contexts' last positions score them
        return _read_depths(depths, criterion, cfg.vocab_size, start, targets, first.__getitem__)

    row_cache = cache.select_rows(owner)
    steps = targets[:, :-1]  # each continuation's tokens but its last, after its context
    out = engine.step(steps, row_cache, deepest, valid=n - 1, collect_states=True)
    final, states = out.logits, out.states
    assert final is not None and states is not None
    positions = m[owner].to(engine.device)[:, None] + torch.arange(steps.shape[1], device=engine.device)
    attend = int(positions.max()) + 1  # as the step attended

    def at_depth(depth: int) -> _DepthView:
        state = states[1 + depth]
        if depth == deepest:
            logits = final
        else:
            logits = _exit_logits(engine, state, engine.context(positions, coda_caches[depth], attend))
        gate = out.gates[depth - 1] if out.gates else None
        before = first[depth]
        gates = None if gate is None or before.gate is None else torch.cat((before.gate, gate), dim=1)
        return _DepthView(torch.cat((before.logits, logits), dim=1), torch.cat((before.state, state), dim=1), gates)

    start = torch.cat((start, initial_state(cfg, states[1], positions, engine.noise)), dim=1)
    return _read_depths(depths, criterion, cfg.vocab_size, start, targets, at_depth)


def _exit_logits(
    engine: Engine, state: torch.Tensor, ctx: StepContext, pick: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """The logits of loop states [B, T, d] through the exit path (at the positions `pick` keeps), on as many
    CPU threads as the step that made them: a forward at that depth then gives the same bits."""
    with cpu_threads_for(engine.device, state.shape[0] * state.shape[1]):
        hidden = exit_hidden(engine.weights, engine.cfg, state, ctx)
        return head(engine.weights, engine.cfg, hidden if pick is None else pick(hidden))


@dataclass(frozen=True)
class _DepthView:
    """What the model gives at one depth for the scored positions [B, N]: logits [B, N, V], the loop state
    [B, N, d], the exit gate's logit [B, N] (models with one)."""

    logits: torch.Tensor
    state: torch.Tensor
    gate: torch.Tensor | None


def _read_depths(
    depths: tuple[int, ...],
    criterion: ExitCriterion | None,
    vocab: int,
    start: torch.Tensor,
    targets: torch.Tensor,
    at_depth: Callable[[int], _DepthView],
) -> DepthLogprobs:
    """Scores of targets [B, N] at each asked depth, one depth at a time (with an exit criterion, every depth
    up to the deepest, each position reading the first that fires); start: the state before the loop."""
    deepest = depths[-1]
    check = _Check(criterion, vocab, start)
    needed = set(depths) if criterion is None else set(range(1, deepest + 1))
    fired = torch.zeros(targets.shape, dtype=torch.long, device=targets.device)  # 0: no check fired yet
    read_lp = torch.zeros(targets.shape, dtype=torch.float64, device=targets.device)
    read_greedy = torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for depth in range(1, deepest + 1):
        if depth not in needed:
            continue
        view = at_depth(depth)
        logp = torch.log_softmax(view.logits.double(), dim=-1)
        lp, greedy = _gather(logp, view.logits, targets)
        if depth in depths:
            early = fired > 0
            rows.append((
                torch.where(early, read_lp, lp),
                torch.where(early, read_greedy, greedy),
                torch.where(early, fired, torch.full_like(fired, depth)),
            ))  # fmt: skip
        if criterion is not None and depth < deepest:
            now = check.fires(depth, logp, view.state, view.gate) & (fired == 0)
            fired = torch.where(now, depth, fired)
            read_lp = torch.where(now, lp, read_lp)
            read_greedy = torch.where(now, greedy, read_greedy)
    lps, greedies, exits = zip(*rows, strict=True)
    return DepthLogprobs(depths, torch.stack(lps), torch.stack(greedies), torch.stack(exits))


def _right_padded(rows: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids.to(device)


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
        self.prev_state = start
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
