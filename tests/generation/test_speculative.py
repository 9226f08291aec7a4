"""Self-speculative decoding: greedy identity with plain decoding, exact rollback, resumed verification."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gen_helpers import PROMPTS, one_row, tiny_engine

from tinyloop.api.model import Model
from tinyloop.config import ArchConfig
from tinyloop.presets import preset
from tinyloop.runtime.decode import decode_row
from tinyloop.runtime.spec_costs import LayerCosts, StepCosts
from tinyloop.runtime.spec_policy import DraftPolicy
from tinyloop.runtime.speculative import SpecConfig, SpeculativeStats, speculative_tokens
from tinyloop.sampling import SamplingParams
from tinyloop.train.tiny_config import TINY_CONFIG

PAIRS = [(1, 4), (2, 8)]


@pytest.fixture(scope="module")
def model(tiny_files):
    with Model(tiny_files["f32"], max_seq_len=256) as m:
        yield m


@pytest.mark.parametrize("draft, verify", PAIRS)
@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_speculative_equals_plain_greedy_api(model, draft, verify, adaptive) -> None:
    for prompt in PROMPTS[:2]:
        plain = model.generate(list(prompt), 24, verify, temperature=0)
        res = model.generate_speculative(list(prompt), 24, draft, verify, 4, adaptive=adaptive)
        assert res.tokens.dtype == np.int32
        np.testing.assert_array_equal(res.tokens, plain)
        assert res.stats.generated_tokens == 24 and res.stats.verify_passes + res.stats.plain_steps >= 1


@pytest.mark.parametrize("draft, verify", PAIRS)
@pytest.mark.parametrize("resume", [True, False])
def test_greedy_identity_when_drafts_are_often_right(draft, verify, resume) -> None:
    engine = tiny_engine(contractive=0.05)
    total = SpeculativeStats()
    for prompt in PROMPTS[1:3]:
        ids = torch.tensor(list(prompt))
        plain = list(
            decode_row(
                engine, engine.new_cache(1, 128, verify), one_row(ids, 32, verify, SamplingParams(temperature=0.0))
            )
        )
        stats = SpeculativeStats()
        spec = SpecConfig(draft, verify, 4, adaptive=False, resume_verify=resume)
        cache = engine.new_cache(1, 128, verify)
        got = list(speculative_tokens(engine, cache, ids, 32, spec, SamplingParams(temperature=0.0), stats))
        assert got == plain
        total.drafted += stats.drafted
        total.accepted += stats.accepted
    # Both paths ran: some drafts accepted, some rejected (rolled back).
    assert 0 < total.accepted < total.drafted


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_draft_ahead_beyond_what_is_left(model, max_tokens) -> None:
    prompt = list(b"abc")
    plain = model.generate(prompt, max_tokens, 4, temperature=0)
    res = model.generate_speculative(prompt, max_tokens, 1, 4, draft_ahead=8, adaptive=False)
    np.testing.assert_array_equal(res.tokens, plain)
    engine = tiny_engine(contractive=0.0)  # every draft accepted: rounds end exactly at max_tokens
    ids = torch.tensor(prompt)
    ref = list(
        decode_row(engine, engine.new_cache(1, 64, 4), one_row(ids, max_tokens, 4, SamplingParams(temperature=0.0)))
    )
    spec = SpecConfig(1, 4, 8, adaptive=False)
    got = list(
        speculative_tokens(engine, engine.new_cache(1, 64, 4), ids, max_tokens, spec, SamplingParams(temperature=0.0))
    )
    assert got == ref


def test_rollback_leaves_the_cache_as_plain_decoding_would() -> None:
    """After speculation, every slot at every kept position equals a plain decode of the same tokens."""
    engine = tiny_engine(contractive=0.05)
    ids = torch.tensor(list(PROMPTS[0]))
    cache = engine.new_cache(1, 128, 8)
    stats = SpeculativeStats()
    got = list(
        speculative_tokens(engine, cache, ids, 30, SpecConfig(2, 8, 4, False), SamplingParams(temperature=0.0), stats)
    )
    assert stats.accepted < stats.drafted  # some rounds were rolled back
    n = int(cache.lengths[0])
    assert n == len(ids) + len(got) - 1  # the last token is sampled, not yet stored
    ref = engine.new_cache(1, 128, 8)
    engine.step(torch.cat((ids, torch.tensor(got[:-1])))[None], ref, 8)
    torch.testing.assert_close(cache.k[:, :, :, :n], ref.k[:, :, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :, :n], ref.v[:, :, :, :n], rtol=1e-5, atol=1e-5)


def test_adaptive_falls_back_to_plain_steps_when_drafts_are_poor(model) -> None:
    res = model.generate_speculative(list(b"Hello"), 40, 1, 4, 4, adaptive=True)
    assert res.acceptance_rate < 0.2
    assert res.stats.plain_steps > 25  # mostly plain decoding, with occasional probes
    fixed = model.generate_speculative(list(b"Hello"), 40, 1, 4, 4, adaptive=False)
    assert fixed.stats.plain_steps <= 1 and fixed.stats.verify_passes > 25


def test_bad_arguments(model) -> None:
    with pytest.raises(ValueError, match="draft_loops"):
        model.generate_speculative([1, 2], 5, draft_loops=4, verify_loops=4)
    with pytest.raises(ValueError, match="draft_ahead"):
        model.generate_speculative([1, 2], 5, draft_ahead=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate_speculative([1, 2], 5, temperature=-1.0)


def prior_policy(
    cfg: ArchConfig, draft: int, verify: int, ahead: int, adaptive: bool = True, device: str = "cpu"
) -> DraftPolicy:
    """A policy deciding by the layer-pass prior alone (what seeded sampling and CUDA use)."""
    costs = StepCosts(LayerCosts.for_device(cfg, draft, verify, device), learn=False)
    return DraftPolicy(costs, ahead, adaptive)


def test_policy_primed_by_the_prompt() -> None:
    cfg = preset("test-tiny")
    poor = prior_policy(cfg, 1, 4, 4)
    poor.prime(0.0, 64)  # drafts never agreed on the prompt: plain for 8 steps, then a one-token probe
    assert [poor.next_k(100) for _ in range(9)] == [0] * 8 + [1]
    poor.update(1, 0)  # the probe failed: a long pause
    assert [poor.next_k(100) for _ in range(65)] == [0] * 64 + [1]
    poor.update(1, 0)
    assert [poor.next_k(1000) for _ in range(129)] == [0] * 128 + [1]
    good = prior_policy(cfg, 2, 8, 4)
    good.prime(0.95, 64)
    assert good.next_k(100) == 4
    pessimistic = prior_policy(preset("seed-407m"), 2, 8, 4, device="cuda")
    pessimistic.prime(0.59, 64)  # seed-407m's agreement over a random prompt: not profitable on its own
    assert [pessimistic.next_k(100) for _ in range(9)] == [0] * 8 + [1]
    ks = []
    for _ in range(6):  # while decoding every draft is accepted: speculation continues and the draft grows
        ks.append(pessimistic.next_k(100))
        pessimistic.update(ks[-1], ks[-1])
    assert ks == [1, 2, 4, 5, 6, 7]
    fixed = prior_policy(cfg, 1, 4, 4, adaptive=False)
    fixed.prime(0.0, 64)
    assert fixed.next_k(100) == 4


def test_adaptive_without_a_prompt_estimate_opens_with_a_probe(model, monkeypatch) -> None:
    import tinyloop.runtime.speculative as speculative

    monkeypatch.setattr(speculative, "PREFILL_ESTIMATE_LOGITS", 0)
    for prompt in PROMPTS[:2]:
        plain = model.generate(list(prompt), 24, 4, temperature=0)
        res = model.generate_speculative(list(prompt), 24, 1, 4, 4)
        np.testing.assert_array_equal(res.tokens, plain)
        assert res.stats.prompt_agreement is None and res.stats.verify_passes >= 1
    res = model.generate_speculative(list(PROMPTS[0]), 24, 1, 4, 4)
    assert res.stats.prompt_agreement is None
    monkeypatch.undo()
    res = model.generate_speculative(list(PROMPTS[0]), 24, 1, 4, 4)
    assert res.stats.prompt_agreement is not None and 0.0 <= res.stats.prompt_agreement <= 1.0


def test_adaptive_with_the_prefill_estimate_off_opens_with_a_probe() -> None:
    engine = tiny_engine(contractive=0.05)
    ids = torch.tensor(list(PROMPTS[1]))
    greedy = SamplingParams(temperature=0.0)
    plain = list(decode_row(engine, engine.new_cache(1, 128, 4), one_row(ids, 24, 4, greedy)))
    for estimate in (True, False):
        stats = SpeculativeStats()
        spec = SpecConfig(1, 4, 4, prefill_estimate=estimate)
        got = list(speculative_tokens(engine, engine.new_cache(1, 128, 4), ids, 24, spec, greedy, stats))
        assert got == plain
        assert (stats.prompt_agreement is not None) == estimate and stats.verify_passes >= 1


def test_policy_on_cuda_speculates_only_for_large_models() -> None:
    """On CUDA a multi-token verification of a small model costs a full step per token (measured), so
    speculation cannot pay there: the adaptive policy starts plain and only probes; on CPU the same
    agreement starts speculating, and so does CUDA for a model of seed-407m's size (verification bound by
    weight bytes)."""
    large = prior_policy(preset("seed-407m"), 2, 8, 4, device="cuda")
    large.prime(1.0, 64)
    assert large.can_pay() and large.next_k(100) == 4
    large.update(4, 4)
    assert large.next_k(100) == 5
    for _ in range(6):  # drafts stop agreeing: back to plain steps
        large.update(large.next_k(100) or 1, 0)
    assert large.next_k(100) == 0

    cpu = prior_policy(TINY_CONFIG, 2, 8, 4)
    cuda = prior_policy(TINY_CONFIG, 2, 8, 4, device="cuda")
    for policy in (cpu, cuda):
        policy.prime(1.0, 64)
    assert cpu.next_k(100) == 4
    assert cuda.best_cost_per_token() > cuda.costs.plain()
    assert [cuda.next_k(100) for _ in range(9)] == [0] * 8 + [1]  # a pause, then a probe
    assert cpu.can_pay() and not cuda.can_pay()


def test_speculation_that_cannot_pay_decodes_plain_outright(model, monkeypatch) -> None:
    """Where no draft length could beat plain decoding (the CUDA cost model, forced here on the CPU), the
    adaptive path is plain decoding itself: same tokens, no verify pass, the stats say so."""
    from tinyloop.runtime import spec_costs

    monkeypatch.setitem(spec_costs.EXTRA_TOKEN_COST_BY_DEVICE, "cpu", 1.0)
    prompt = list(PROMPTS[1])
    plain = model.generate(prompt, 20, loops=8, temperature=0.0)
    res = model.generate_speculative(prompt, 20, 2, 8, 4)
    np.testing.assert_array_equal(res.tokens, plain)
    assert res.stats.verify_passes == 0 and res.stats.plain_steps == 19 and res.stats.stop_reason == "max_tokens"
    stop = int(plain[5])
    cut = model.generate_speculative(prompt, 20, 2, 8, 4, stop_tokens=[stop])
    np.testing.assert_array_equal(cut.tokens, plain[: list(plain).index(stop)])
    assert cut.stats.stop_reason == "stop_token"
