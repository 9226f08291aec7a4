"""Token-stable early exit in scoring: exact when nothing exits, consistent and cheaper when positions do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyloop
from tinyloop.runtime.token_exit import score_with_token_exit

TOKENS = np.array([5, 77, 12, 9, 200, 31, 31, 31, 8, 64, 3], dtype=np.int32)


@pytest.fixture(scope="module")
def model(tiny_files):
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as m:
        yield m


def test_patience_beyond_loops_equals_plain_scoring(model) -> None:
    plain = model.score(TOKENS, loops=4)
    exited = model.score(TOKENS, loops=4, token_exit=10)
    assert np.allclose(exited, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


def test_positions_exit_and_the_rest_continue(model, monkeypatch, capsys) -> None:
    res = score_with_token_exit(model._engine, torch.from_numpy(TOKENS.astype(np.int64)), 12, 1)
    assert res.exit_depth.min() >= 2 and res.exit_depth.max() <= 12
    assert 0.0 < res.body_fraction_saved < 1.0
    monkeypatch.setattr(model, "env", model.env.__class__(**{**model.env.__dict__, "token_exit_verbose": True}))
    model.score(TOKENS, loops=12, token_exit=1)
    err = capsys.readouterr().err
    assert "token exit depths" in err and "compute saved" in err


def test_environment_variable_turns_it_on(tiny_files, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TINYLOOP_TOKEN_EXIT", "1")
    monkeypatch.setenv("TINYLOOP_TOKEN_EXIT_VERBOSE", "1")
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as m:
        m.score_last(TOKENS, loops=6)
    assert "compute saved" in capsys.readouterr().err


def test_bad_token_exit_argument(model) -> None:
    with pytest.raises(ValueError, match="token_exit"):
        model.score(TOKENS, loops=2, token_exit=-1)
