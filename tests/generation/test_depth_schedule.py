"""Depth schedule: N=0 is plain generation; N>0 runs the first N decode steps shallow and fills the
skipped iterations' K/V with the position's deepest computed iteration (DepthSchedule's rule)."""

from __future__ import annotations

import numpy as np
import torch
from gen_helpers import one_row, tiny_engine

from tinyloop.api.model import Model
from tinyloop.model.slots import body_slot
from tinyloop.runtime.decode import decode_row
from tinyloop.runtime.depth_schedule import DepthSchedule
from tinyloop.sampling import SamplingParams


def test_no_warmup_equals_plain(tiny_files) -> None:
    with Model(tiny_files["f32"], max_seq_len=128) as m:
        plain = {}
        for temperature, seed in ((0.0, None), (0.9, 4)):
            plain[temperature] = m.generate(list(b"Hello"), 20, 4, temperature=temperature, seed=seed)
            same = m.generate(list(b"Hello"), 20, 4, temperature=temperature, seed=seed, l_warmup_tokens=0)
            np.testing.assert_array_equal(plain[temperature], same)
        shallow = m.generate(list(b"Hello"), 20, 4, temperature=0, l_warmup_tokens=6, l_warmup_loops=1)
        assert len(shallow) == 20 and shallow[0] == plain[0.0][0]  # the prefill token runs at full depth


def test_warmup_follows_the_documented_rule() -> None:
    engine = tiny_engine()
    cfg, loops, shallow, n_warm = engine.cfg, 4, 2, 3
    prompt = torch.tensor(list(b"The meaning"))
    cache = engine.new_cache(1, 64, loops)
    params = SamplingParams(temperature=0.0)
    got = list(decode_row(engine, cache, one_row(prompt, 6, loops, params, schedule=DepthSchedule(n_warm, shallow))))
    p0 = len(prompt)
    # Rule: at each shallow position, every skipped iteration's slots hold iteration shallow-1's K/V.
    for pos in range(p0, p0 + n_warm):
        for t in range(shallow, loops):
            for j in range(cfg.n_body):
                src, dst = body_slot(cfg, shallow - 1, j), body_slot(cfg, t, j)
                assert torch.equal(cache.k[dst, :, :, pos], cache.k[src, :, :, pos])
                assert torch.equal(cache.v[dst, :, :, pos], cache.v[src, :, :, pos])

    # Independent reference: prefill at full depth, shallow steps, copy by hand, then full-depth steps.
    ref_cache = engine.new_cache(1, 64, loops)
    logits = engine.step(prompt[None], ref_cache, loops, last_only=True).logits
    ref = [int(logits[0, -1].argmax())]
    for step in range(1, 6):
        depth = shallow if step <= n_warm else loops
        logits = engine.step(torch.tensor([[ref[-1]]]), ref_cache, depth, last_only=True).logits
        if depth < loops:
            pos = int(ref_cache.lengths[0]) - 1
            for t in range(shallow, loops):
                for j in range(cfg.n_body):
                    ref_cache.k[body_slot(cfg, t, j), :, :, pos] = ref_cache.k[
                        body_slot(cfg, shallow - 1, j), :, :, pos
                    ]
                    ref_cache.v[body_slot(cfg, t, j), :, :, pos] = ref_cache.v[
                        body_slot(cfg, shallow - 1, j), :, :, pos
                    ]
        ref.append(int(logits[0, -1].argmax()))
    assert got == ref
