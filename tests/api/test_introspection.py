"""Logit lens, trajectory, uncertainty and consistency: exact against separate naive runs per depth."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyloop
from helpers import frob_rel_error, max_rel_error, random_flat_weights
from naive_reference import naive_forward
from tinyloop.presets import preset
from tinyloop.runtime.introspect import stable_depth

TOKENS = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32], dtype=np.int32)
LOOPS = 5


@pytest.fixture(scope="module")
def model(tiny_files):
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as m:
        yield m


@pytest.fixture(scope="module")
def naive_runs():
    cfg = preset("test-tiny")
    flat = random_flat_weights(cfg, seed=7)
    return [naive_forward(cfg, flat, TOKENS.tolist(), depth) for depth in range(1, LOOPS + 1)]


def test_lens_rows_equal_separate_runs_at_each_depth(model, naive_runs) -> None:
    lens = model.score_logit_lens(TOKENS, loops=LOOPS)
    assert lens.shape == (LOOPS, len(TOKENS), 256) and lens.dtype == np.float32
    for depth, (ref_logits, _, _) in enumerate(naive_runs):
        assert max_rel_error(torch.from_numpy(lens[depth]), ref_logits) <= 1e-5, depth
    assert np.array_equal(lens[-1], model.score(TOKENS, loops=LOOPS))


def test_lens_positions_and_top_k(model) -> None:
    full = model.score_logit_lens(TOKENS, loops=LOOPS)
    some = model.score_logit_lens(TOKENS, loops=LOOPS, positions=[0, -1])
    assert np.array_equal(some, full[:, [0, -1]])
    idx, val = model.score_logit_lens(TOKENS, loops=LOOPS, top_k=4)
    assert idx.shape == val.shape == (LOOPS, len(TOKENS), 4) and idx.dtype == np.int32
    assert np.array_equal(idx[..., 0], full.argmax(-1))
    assert np.allclose(val[..., 0], full.max(-1))
    with pytest.raises(ValueError, match="positions"):
        model.score_logit_lens(TOKENS, loops=2, positions=[len(TOKENS)])
    with pytest.raises(ValueError, match="top_k"):
        model.score_logit_lens(TOKENS, loops=2, top_k=0)


def test_trajectory_matches_naive_states(model, naive_runs) -> None:
    traj = model.score_trajectory(TOKENS, loops=LOOPS)
    assert traj.shape == (2 + LOOPS, len(TOKENS), 64)
    _, ref_states, _ = naive_runs[-1]
    for got, ref in zip(traj, ref_states, strict=True):
        assert frob_rel_error(torch.from_numpy(got), ref) <= 1e-5


def test_uncertainty_kl_matches_hand_computation(model, naive_runs) -> None:
    res = model.score_with_uncertainty(TOKENS, loops=LOOPS)
    assert res.kl.shape == (LOOPS - 1, len(TOKENS))
    for i in range(LOOPS - 1):
        p = torch.log_softmax(naive_runs[i + 1][0], -1)
        q = torch.log_softmax(naive_runs[i][0], -1)
        ref = (p.exp() * (p - q)).sum(-1)
        assert np.allclose(res.kl[i], ref.numpy(), rtol=1e-3, atol=1e-6)
    assert np.array_equal(res.kl_final, res.kl[-1])
    assert (res.entropy > 0).all() and (res.entropy <= np.log(256) + 1e-4).all()


def test_consistency_gate_and_stable_depth(model) -> None:
    res = model.score_with_consistency(TOKENS, loops=LOOPS, window=2)
    lens = model.score_logit_lens(TOKENS, loops=LOOPS)
    assert np.array_equal(res.argmax, lens.argmax(-1))
    assert np.array_equal(res.consistent, res.argmax[-1] == res.argmax[-2])
    with pytest.raises(ValueError, match="window"):
        model.score_with_consistency(TOKENS, loops=3, window=4)


def test_stable_depth_by_hand() -> None:
    argmax = torch.tensor([[1, 5, 2], [2, 5, 2], [2, 5, 3], [2, 5, 2]])
    assert stable_depth(argmax).tolist() == [2, 1, 4]


def test_batches_equal_per_sequence_results(model) -> None:
    batch = np.stack([TOKENS, TOKENS[::-1], (TOKENS + 7) % 256]).astype(np.int32)
    lens = model.score_logit_lens(batch, loops=3)
    traj = model.score_trajectory(batch, loops=3)
    unc = model.score_with_uncertainty(batch, loops=3)
    cons = model.score_with_consistency(batch, loops=3, window=2)
    assert lens.shape == (3, 3, len(TOKENS), 256) and traj.shape == (3, 5, len(TOKENS), 64)
    for b, row in enumerate(batch):
        np.testing.assert_allclose(lens[b], model.score_logit_lens(row, loops=3), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(traj[b], model.score_trajectory(row, loops=3), rtol=1e-5, atol=1e-5)
        single = model.score_with_uncertainty(row, loops=3)
        np.testing.assert_allclose(unc.kl[b], single.kl, rtol=1e-3, atol=1e-6)
        one = model.score_with_consistency(row, loops=3, window=2)
        assert np.array_equal(cons.argmax[b], one.argmax) and np.array_equal(cons.stable_depth[b], one.stable_depth)
    idx, val = model.score_logit_lens(batch.tolist(), loops=2, top_k=3, positions=[0])
    assert idx.shape == val.shape == (3, 2, 1, 3)
    with pytest.raises(ValueError, match="equal lengths"):
        model.score_trajectory([[1, 2, 3], [4, 5]], loops=2)


def test_continuations_after_a_shared_context_equal_whole_sequences_and_naive_runs(model) -> None:
    cfg, flat = preset("test-tiny"), random_flat_weights(preset("test-tiny"), seed=7)
    groups = [(TOKENS[:5], [TOKENS[5:], [7], [200, 1, 2]]), ([9, 8], [[1, 2, 3, 4, 5, 6], [40, 41]])]
    for kwargs in ({}, {"exit_criterion": "kl", "exit_tol": 0.05}, {"exit_criterion": "latent", "exit_tol": 0.5}):
        got = model.score_continuations(groups, [1, 3, 5], **kwargs)
        for (context, continuations), scores in zip(groups, got, strict=True):
            for continuation, res in zip(continuations, scores, strict=True):
                tokens, n = [*context, *continuation], len(continuation)
                whole = model.score_token_logprobs(tokens, [1, 3, 5], **kwargs)
                assert res.logprob.shape == (3, n) and np.array_equal(res.exit_depth, whole.exit_depth[:, -n:])
                np.testing.assert_allclose(res.logprob, whole.logprob[:, -n:], rtol=0, atol=1e-5)
                assert np.array_equal(res.greedy, whole.greedy[:, -n:])
                if not kwargs and continuation is continuations[0]:  # the float64 reference is slow: a few runs
                    for d, depth in ((0, 1), (2, 5)):
                        logits, _, _ = naive_forward(cfg, flat, tokens[:-1], depth)
                        ref = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
                        np.testing.assert_allclose(res.logprob[d], ref[-n:].numpy(), rtol=0, atol=1e-4)
    assert (got[0][0].exit_depth[2] < 5).any(), "the latent tolerance must let some positions exit early"
    # Every continuation one token long: the contexts' last positions score them all.
    (one,) = model.score_continuations([(TOKENS, [[5], [6], [7]])], 3)
    whole = model.score_token_logprobs([[*TOKENS, t] for t in (5, 6, 7)], 3)
    np.testing.assert_allclose(np.concatenate([r.logprob for r in one], 1), whole.logprob[0, :, -1:].T, atol=1e-5)
    bad = [([], "non-empty"), ([(TOKENS, [])], "no continuations"), ([([], [[1]])], "context must not be empty"),
           ([(TOKENS, [[1] * 60])], "max_seq_len 64")]  # fmt: skip
    for groups, match in bad:
        with pytest.raises(ValueError, match=match):
            model.score_continuations(groups, 2)
