"""The speculative policy's measured step costs, driven by a fake clock: it speculates where verification is
cheap, decodes plain (probing now and then) where it is dear, and greedy tokens stay those of plain decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gen_helpers import PROMPTS, one_row, tiny_engine

from tinyloop.presets import preset
from tinyloop.runtime.decode import decode_row
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.spec_costs import PLAIN_REFRESH_ROUNDS, SAMPLES_KEPT, LayerCosts, StepCosts
from tinyloop.runtime.spec_policy import DraftPolicy
from tinyloop.runtime.speculative import SpecConfig, SpeculativeStats, speculative_tokens, step_costs
from tinyloop.sampling import SamplingParams
from tinyloop.train.tiny_config import TINY_CONFIG

PLAIN_S, DRAFT_S = 0.010, 0.003


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def dear_verify(rows: int) -> float:
    """Almost a plain step per row (as on CUDA for a small model): no round can beat plain steps."""
    return 0.9 * PLAIN_S * rows


def cheap_verify(rows: int) -> float:
    return 0.75 * PLAIN_S + 0.05 * PLAIN_S * rows


def test_costs_are_ratios_to_the_draft_steps_timed_with_them() -> None:
    prior = LayerCosts.for_device(TINY_CONFIG, 2, 8, "cpu")
    prior_plain = prior.plain() / prior.draft()
    costs = StepCosts(prior, clock=FakeClock())
    assert (costs.draft(), costs.plain(), costs.verify(5)) == pytest.approx(
        (prior.draft(), prior.plain(), prior.verify(5))
    )
    costs.add_plain(0.030)  # no round yet: nothing to time it against
    costs.add_round(3, 0.012, 2, 0.010)  # draft steps of 4 ms, a verify pass of 2 rows worth 2.5 of them
    assert costs.draft() == pytest.approx(0.004) and costs.verify(2) == pytest.approx(0.010)
    assert costs.plain() == pytest.approx(0.004 * prior_plain)  # the prior's ratio
    costs.add_plain(0.012)
    costs.add_plain(0.012)  # right after the round: 3 of its draft steps, against the prior's 2 samples
    assert costs.plain() == pytest.approx(0.004 * (3 + prior_plain) / 2)
    # The machine slows down by half (another process): all costs move together, whatever was timed when.
    costs.add_round(3, 0.024, 6, 0.060)  # draft steps of 8 ms, 6 rows worth 7.5 of them
    costs.add_plain(0.024)
    costs.add_plain(0.024)
    for _ in range(5):
        costs.add_plain(0.100)  # a pause's later plain steps are not timed against old draft steps
    assert costs.draft() == pytest.approx(0.006)  # the median of 4 and 8 ms
    assert costs.plain() == pytest.approx(3 * 0.006) and costs.verify(6) == pytest.approx(7.5 * 0.006)
    assert costs.verify(2) == pytest.approx(2.5 * 0.006)
    assert costs.verify(4) == pytest.approx(5.0 * 0.006)  # between two measured row counts: linear
    assert costs.verify(8) == pytest.approx(10.0 * 0.006)  # above them: the fitted slope
    assert costs.verify(1) == pytest.approx(2.5 * 0.006 * prior.verify(1) / prior.verify(2))  # below: prior's shape
    assert costs.round(3) == pytest.approx(4 * 0.006 + 5.0 * 0.006)


def test_estimates_are_medians_of_recent_samples() -> None:
    costs = StepCosts(LayerCosts.for_device(TINY_CONFIG, 2, 8, "cpu"), clock=FakeClock())
    costs.add_round(1, 0.100, 2, 0.100)  # a first call's spike
    assert costs.draft() == 0.100
    costs.add_round(1, 0.010, 2, 0.020)
    costs.add_round(1, 0.012, 2, 0.024)
    assert costs.draft() == 0.012 and costs.verify(2) == pytest.approx(2 * 0.012)  # the spike no longer counts
    for _ in range(SAMPLES_KEPT):
        costs.add_round(1, 0.005, 2, 0.010)  # only the recent samples count
    assert costs.draft() == 0.005


def test_a_plain_step_is_timed_every_few_rounds() -> None:
    costs = StepCosts(LayerCosts.for_device(TINY_CONFIG, 2, 8, "cpu"))
    for _ in range(PLAIN_REFRESH_ROUNDS):
        assert not costs.wants_plain_sample()
        costs.add_round(5, 0.02, 5, 0.02)
    assert costs.wants_plain_sample()
    costs.add_plain(0.01)
    assert not costs.wants_plain_sample()
    fixed = StepCosts(LayerCosts.for_device(TINY_CONFIG, 2, 8, "cpu"), learn=False)
    for _ in range(PLAIN_REFRESH_ROUNDS):
        fixed.add_round(5, 5.0, 5, 5.0)
    fixed.add_plain(5.0)
    assert not fixed.wants_plain_sample()
    assert (fixed.plain(), fixed.verify(5)) == (fixed.prior.plain(), fixed.prior.verify(5))


def simulate(verify_s, tokens: int = 700) -> tuple[list[int], float]:
    """Drive a policy as the decode loop does, every draft accepted, each step advancing a fake clock by its
    cost. Returns the draft lengths chosen (0: a plain step) and the time taken."""
    clock = FakeClock()
    costs = StepCosts(LayerCosts.for_device(TINY_CONFIG, 2, 8, "cpu"), clock=clock)
    policy = DraftPolicy(costs, 4, adaptive=True)
    policy.prime(1.0, 64)  # the prior expects speculation to pay
    start, ks, produced = clock(), [], 0
    while produced < tokens:
        k = policy.next_k(tokens - produced)
        ks.append(k)
        t = clock()
        if k == 0:
            clock.advance(PLAIN_S)
            costs.add_plain(clock() - t)
            produced += 1
            continue
        clock.advance((k + 1) * DRAFT_S)
        draft_s, t = clock() - t, clock()
        clock.advance(verify_s(k + 1))
        costs.add_round(k + 1, draft_s, k + 1, clock() - t)
        policy.update(k, k)
        produced += k + 1
    return ks, clock() - start


def test_dear_verification_stops_speculation_and_probes_now_and_then() -> None:
    ks, seconds = simulate(dear_verify)
    rounds = [i for i, k in enumerate(ks) if k]
    # The round the prior asked for, then one-token probes only.
    assert [ks[i] for i in rounds] == [4, 1, 1, 1, 1] and rounds[0] == 0
    gaps = [b - a - 1 for a, b in zip(rounds, rounds[1:], strict=False)]
    assert gaps == [8, 64, 128, 256]  # plain steps between probes, doubling
    assert seconds < 1.02 * 700 * PLAIN_S  # the probes cost under 2 % against plain decoding


def test_cheap_verification_speculates() -> None:
    ks, seconds = simulate(cheap_verify)
    assert ks[:5] == [4, 5, 6, 7, 8]
    assert ks.count(0) <= 700 // (5 * PLAIN_REFRESH_ROUNDS)  # the timed plain steps only
    assert max(ks) == 8  # fully accepted rounds grew to 2 x draft_ahead
    assert seconds < 0.6 * 700 * PLAIN_S


def test_a_length_that_would_not_pay_is_cut_to_one_that_does() -> None:
    """Verification that turns dear above 5 rows (as when a kernel for few rows hands over to another):
    fully accepted rounds stop growing at 4 drafts instead of pausing speculation."""
    ks, seconds = simulate(lambda rows: 0.5 * PLAIN_S + (0.05 if rows <= 5 else 1.0) * PLAIN_S * rows)
    assert ks[:3] == [4, 5, 4]  # one round at 5 drafts measures 6 rows
    assert set(ks[2:-1]) <= {0, 4} and ks.count(4) > 100  # (the last round drafts what is left)
    assert seconds < 0.6 * 700 * PLAIN_S


def charged_engine(engine: Engine, clock: FakeClock, verify_s, verify_loops: int) -> Engine:
    """engine whose steps also advance `clock` by what the step would cost on some machine."""
    step = engine.step

    def charged(tokens: torch.Tensor, cache, loops: int, **kwargs):  # type: ignore[no-untyped-def]
        out = step(tokens, cache, loops, **kwargs)
        rows = tokens.shape[1]
        if kwargs.get("resume") is not None:
            clock.advance(verify_s(rows))
        elif rows == 1:
            clock.advance(PLAIN_S if loops == verify_loops else DRAFT_S)
        return out

    engine.step = charged  # type: ignore[method-assign]
    return engine


@pytest.mark.parametrize("verify_s", [dear_verify, cheap_verify])
def test_decode_loop_learns_the_costs_and_keeps_plain_tokens(verify_s) -> None:
    clock = FakeClock()
    engine = charged_engine(tiny_engine(contractive=0.0), clock, verify_s, 8)  # every draft accepted
    greedy = SamplingParams(temperature=0.0)
    ids = torch.tensor(list(PROMPTS[0]))
    plain = list(decode_row(engine, engine.new_cache(1, 256, 8), one_row(ids, 200, 8, greedy)))
    stats = SpeculativeStats()
    costs = StepCosts(LayerCosts.for_device(engine.cfg, 2, 8, "cpu"), clock=clock)
    cache = engine.new_cache(1, 256, 8)
    got = list(speculative_tokens(engine, cache, ids, 200, SpecConfig(2, 8, 4), greedy, stats, costs=costs))
    assert got == plain
    assert stats.accepted == stats.drafted > 0
    assert (costs.draft(), costs.verify(5)) == pytest.approx((DRAFT_S, verify_s(5)))  # the first round drafted 4
    if verify_s is dear_verify:  # pauses start right after rounds: enough plain steps timed to outvote the prior
        assert costs.plain() == pytest.approx(PLAIN_S)
        assert stats.verify_passes <= 4 and stats.plain_steps > 180  # plain, with a few probes
        assert stats.draft_s + stats.verify_s + stats.plain_s < 1.05 * 199 * PLAIN_S
    else:
        assert stats.plain_steps <= 3 and stats.spec_tokens > 190
        assert stats.draft_s + stats.verify_s + stats.plain_s < 0.6 * 199 * PLAIN_S


def test_costs_are_learned_on_the_cpu_only_and_not_for_seeded_sampling(tiny_files) -> None:
    spec = SpecConfig(2, 8, 4)
    cpu = SimpleNamespace(cfg=preset("test-tiny"), device=torch.device("cpu"))
    cuda = SimpleNamespace(cfg=preset("test-tiny"), device=torch.device("cuda"))
    greedy, unseeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)
    seeded = SamplingParams(temperature=0.8, seed=3)
    assert step_costs(cpu, spec, greedy).learn and step_costs(cpu, spec, unseeded).learn  # type: ignore[arg-type]
    assert not step_costs(cpu, spec, seeded).learn and not step_costs(cuda, spec, greedy).learn  # type: ignore[arg-type]
    from tinyloop.api.model import Model

    with Model(tiny_files["f32"], max_seq_len=128) as m:
        runs = [m.generate_speculative(list(b"Hello"), 40, 2, 8, temperature=1.0, seed=11).tokens for _ in range(2)]
    assert runs[0].tolist() == runs[1].tolist()
