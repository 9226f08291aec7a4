"""Generation with the looped families' exit mechanisms, through the decode loop: Ouro's exit rules (every
loop runs, the output read from the chosen loop) as a row's own step, per-token adaptive depth as the
row's exit criterion in the batched step."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tinyloop.cache.base import StepCache
from tinyloop.cache.kv import KVCache
from tinyloop.runtime.adaptive_exit import ExitCriterion, FamilyStats, rule_step
from tinyloop.runtime.decode import Row, decode_row
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.family_exit import ExitRule, check_supported
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.sampling import SamplingParams


def stream_family(
    engine: Engine,
    cache: StepCache | None,
    prompt: torch.Tensor,
    max_tokens: int,
    loops: int,
    params: SamplingParams,
    rule: ExitRule | None = None,
    criterion: ExitCriterion | None = None,
    stop_ids: tuple[int, ...] = (),
    stats: FamilyStats | None = None,
) -> Iterator[int]:
    """Yield new ids (a stop id ends the stream and is not yielded). `rule` reads Ouro's gate over all loops
    (the reference's semantics); `criterion` exits each decode token early. Not both. `cache`: the
    request's cache of the model's KV mode (None: a private dense one)."""
    rule = rule or ExitRule()
    if criterion is not None and not rule.is_last:
        raise ValueError("use either an exit rule (exit_threshold / exit_at_step / weighted_exit) or an exit criterion")
    check_supported(engine.cfg, rule, loops)
    if criterion is not None and criterion.kind == "gate" and not engine.cfg.exit_gate:
        raise ValueError("the 'gate' exit criterion needs a model with an exit gate (Ouro)")
    stats = stats if stats is not None else FamilyStats()
    work: StepCache = (
        cache
        if cache is not None
        else KVCache(engine.cfg, 1, int(prompt.numel()) + max_tokens, loops, engine.device, engine.dtype)
    )
    picker = TokenPicker(params, None, frozenset(stop_ids))
    if rule.is_last:
        row = Row(prompt, loops, max_tokens, picker, stats=stats, exit=criterion)
    else:

        def first() -> torch.Tensor:
            work.truncate(0)
            return rule_step(engine, work, prompt.to(torch.long).view(1, -1), loops, rule)

        def step(token: int) -> torch.Tensor:
            return rule_step(engine, work, torch.tensor([[token]]), loops, rule)

        row = Row(prompt, loops, max_tokens, picker, stats=stats, start=first, step=step)
    try:
        yield from decode_row(engine, work, row)
    finally:
        # The prompt runs the full depth; then one entry per decode step (its iterations).
        generated = stats.generated_tokens
        stats.exit_depths[:] = ([loops] + (row.step_depths or [loops] * max(generated - 1, 0)))[:generated]
