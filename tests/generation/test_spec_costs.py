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


def test_estimates_are_medians_of_recent_samples_and_fill_in_unmeasured_rows() -> None:
    prior = LayerCosts.for_device(TINY_CONFIG, 2, 8, "cpu")
    costs = StepCosts(prior, clock=FakeClock())
    assert costs.plain() == prior.plain() and costs.verify(5) == prior.verify(5)  # nothing measured: the prior
    costs.add_plain(0.200)  # a first call's spike
    assert costs.plain() == 0.200
    costs.add_plain(0.020)
    costs.add_plain(0.015)
    assert costs.plain() == 0.020  # the spike no longer counts
    for _ in range(SAMPLES_KEPT):
        costs.add_plain(0.015)  # the machine got faster: only the recent samples count
    assert costs.plain() == 0.015
    per_layer = 0.015 / prior.plain()  # kinds not timed yet: the prior in seconds at the plain step's rate
    assert costs.draft() == pytest.approx(prior.draft() * per_layer)
    assert costs.verify(3) == pytest.approx(prior.verify(3) * per_layer)
    costs.add_draft(3, 0.012)
    assert costs.draft() == pytest.approx(0.004)
    costs.add_verify(2, 0.010)
    assert costs.verify(5) == pytest.approx(0.010 * prior.verify(5) / prior.verify(2))  # one point: prior's shape
    costs.add_verify(6, 0.030)
    assert costs.verify(4) == pytest.approx(0.020)  # between two points: linear
    assert costs.verify(8) == pytest.approx(0.040)  # above them: the fitted slope
    assert costs.verify(1) == pytest.approx(0.010 * prior.verify(1) / prior.verify(2))
    assert costs.round(3) == pytest.approx(4 * 0.004 + 0.020)


def test_plain_steps_are_timed_first_and_now_and_then() -> None:
    costs = StepCosts(LayerCosts.for_device(TINY_CONFIG, 2, 8, "cpu"))
    assert costs.wants_plain_sample()
    costs.add_plain(0.01)
    assert costs.wants_plain_sample()
    costs.add_plain(0.01)
    assert not costs.wants_plain_sample()
    for _ in range(PLAIN_REFRESH_ROUNDS):
        costs.add_verify(5, 0.02)
    assert costs.wants_plain_sample()
    fixed = StepCosts(LayerCosts.for_device(TINY_CONFIG, 2, 8, "cpu"), learn=False)
    fixed.add_plain(5.0)
    fixed.add_verify(5, 5.0)
    assert not fixed.wants_plain_sample() and fixed.plain() == fixed.prior.plain()


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
        costs.add_draft(k + 1, clock() - t)
        t = clock()
        clock.advance(verify_s(k + 1))
        costs.add_verify(k + 1, clock() - t)
        policy.update(k, k)
        produced += k + 1
    return ks, clock() - start


def test_dear_verification_stops_speculation_and_probes_now_and_then() -> None:
    ks, seconds = simulate(dear_verify)
    rounds = [i for i, k in enumerate(ks) if k]
    # Two plain steps timed, the round the prior asked for, one at the longest length (which by the prior's
    # shape of verify costs, scaled to the one measured, might still pay), then one-token probes only.
    assert [ks[i] for i in rounds] == [4, 8, 1, 1, 1, 1] and rounds[0] == 2
    gaps = [b - a - 1 for a, b in zip(rounds[1:], rounds[2:], strict=False)]
    assert gaps == [8, 64, 128, 256]  # plain steps between probes, doubling
    assert seconds < 1.02 * 700 * PLAIN_S  # the probes cost under 2 % against plain decoding


def test_cheap_verification_speculates() -> None:
    ks, seconds = simulate(cheap_verify)
    assert ks[:3] == [0, 0, 4]
    assert ks.count(0) <= 2 + 700 // (5 * PLAIN_REFRESH_ROUNDS) + 1  # the timed plain steps only
    assert max(ks) == 8  # fully accepted rounds grew to 2 x draft_ahead
    assert seconds < 0.6 * 700 * PLAIN_S


def test_a_length_that_would_not_pay_is_cut_to_one_that_does() -> None:
    """Verification that turns dear above 5 rows (as when a kernel for few rows hands over to another):
    fully accepted rounds stop growing at 4 drafts instead of pausing speculation."""
    ks, seconds = simulate(lambda rows: 0.5 * PLAIN_S + (0.05 if rows <= 5 else 1.0) * PLAIN_S * rows)
    assert ks[:4] == [0, 0, 4, 5]  # one round at 5 drafts measures 6 rows
    assert set(ks[4:-1]) <= {0, 4} and ks.count(4) > 100  # (the last round drafts what is left)
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
    measured = (costs.plain(), costs.draft(), costs.verify(5))  # the first round drafted 4
    assert measured == pytest.approx((PLAIN_S, DRAFT_S, verify_s(5)))
    if verify_s is dear_verify:
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
