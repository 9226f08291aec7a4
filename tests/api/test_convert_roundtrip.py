"""Convert a PyTorch checkpoint -> load -> logits equal the source weights' (16/32-bit), bounded error quantized."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tinyloop
from helpers import max_rel_error, random_flat_weights
from naive_reference import naive_forward
from tinyloop.cli.convert import main as convert_main
from tinyloop.presets import preset

TOKENS = [7, 200, 31, 64, 99, 5, 18, 250]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = preset("test-tiny")
    flat = random_flat_weights(cfg, seed=11)
    root = tmp_path_factory.mktemp("ckpt")
    torch.save({"model": flat}, root / "model.pt")
    (root / "config.json").write_text(json.dumps(cfg.to_dict()))
    ref, _, _ = naive_forward(cfg, flat, TOKENS, 3)
    return root, ref


@pytest.mark.parametrize(
    "flags, bound",
    [(["--bits", "16", "--float-dtype", "f32"], 1e-5), (["--bits", "16"], 5e-3), (["--bits", "8"], 0.06),
     (["--bits", "4", "--group-size", "32"], 0.8)],
)  # fmt: skip
def test_converted_file_reproduces_the_checkpoint(checkpoint, tmp_path, flags, bound) -> None:
    root, ref = checkpoint
    out = tmp_path / "m.tinyloop"
    rc = convert_main([str(root / "model.pt"), "--config", str(root / "config.json"), "-o", str(out), *flags])
    assert rc == 0 and out.exists()
    with tinyloop.Model(out, max_seq_len=64) as m:
        got = torch.from_numpy(m.score(np.array(TOKENS, dtype=np.int32), loops=3))
    err = max_rel_error(got, ref)
    assert err <= bound, f"{flags}: {err:.2e}"
