"""Warm start: a handle built at L continues at a deeper L by running only the missing iterations and
the coda, and equals a fresh run at the deeper L in every KV mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cache_helpers import engine_for, random_tokens

from helpers import max_rel_error
from tinyloop.api.model import Model
from tinyloop.cache.factory import KVModeChoice, make_cache

PROMPT = np.array([72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 32, 9], dtype=np.int32)


@pytest.mark.parametrize("mode", ["16bit", "int8", "hidden", "window", "none"])
def test_resume_to_a_deeper_loop_count_equals_a_fresh_run(models, mode: str) -> None:
    m = models[mode]
    handle = m.build_resume_handle(PROMPT, loops=4)
    assert handle.loops == 4 and handle.nbytes > 0
    fresh = m.generate(PROMPT, max_tokens=10, loops=8, temperature=0.0)
    assert m.resume_generate(handle, loops=8, max_tokens=10, temperature=0.0).tolist() == fresh.tolist()
    # The handle is untouched by the deeper run: resuming again (or at the same depth) still works.
    same = m.generate(PROMPT, max_tokens=6, loops=4, temperature=0.0)
    assert m.resume_generate(handle, max_tokens=6, temperature=0.0).tolist() == same.tolist()
    assert (
        m.resume_generate(handle, loops=6, max_tokens=6, temperature=0.0).tolist()
        == m.generate(PROMPT, max_tokens=6, loops=6, temperature=0.0).tolist()
    )


def test_resume_runs_only_the_missing_iterations(models, monkeypatch) -> None:
    import tinyloop.model.looped as looped

    m = models["16bit"]
    handle = m.build_resume_handle(PROMPT, loops=4)
    ran: list[int] = []
    real = looped.iterate

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        ran.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(looped, "iterate", spy)
    m.resume_generate(handle, loops=8, max_tokens=1, temperature=0.0)
    assert ran == [4, 5, 6, 7]


@pytest.mark.parametrize("mode", ["16bit", "int8", "hidden", "window"])
def test_resumed_logits_equal_a_fresh_deep_run(mode: str) -> None:
    _, engine = engine_for("huginn-like")
    tokens = random_tokens(engine.cfg, 12, seed=9)
    choice = KVModeChoice(mode, 5 if mode == "window" else 0)
    ids = torch.tensor([tokens])
    shallow_cache = make_cache(choice, engine.cfg, 1, 32, 8, engine.device, engine.dtype)
    shallow = engine.step(ids, shallow_cache, 4)
    deep = engine.step(ids, shallow_cache, 8, start=torch.tensor([0]),
                       resume=shallow.resume_at(4))  # fmt: skip
    fresh = engine.step(ids, make_cache(choice, engine.cfg, 1, 32, 8, engine.device, engine.dtype), 8)
    assert max_rel_error(deep.logits[0], fresh.logits[0]) <= 1e-5


def test_shallower_resume_is_refused_with_the_fix(models) -> None:
    m = models["16bit"]
    handle = m.build_resume_handle(PROMPT, loops=4)
    with pytest.raises(ValueError, match=r"only go deeper.*build_resume_handle"):
        m.resume_generate(handle, loops=2, max_tokens=3)
    with pytest.raises(ValueError, match="belongs to model"):
        models["int8"].resume_generate(handle, loops=8, max_tokens=3)


def test_a_handle_survives_generations_in_between(models) -> None:
    m: Model = models["int8"]
    handle = m.build_resume_handle(PROMPT, loops=3)
    m.generate(PROMPT[::-1].copy(), max_tokens=20, loops=6, temperature=0.0)  # reuses the working cache
    fresh = m.generate(PROMPT, max_tokens=8, loops=6, temperature=0.0)
    assert m.resume_generate(handle, loops=6, max_tokens=8, temperature=0.0).tolist() == fresh.tolist()
