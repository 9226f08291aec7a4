"""Bits per byte, the fixed validation windows, the parse rule, headers, and the CPU evaluation report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import random_flat_weights
from tinyloop.train.codegen import body_lines, find_headers, function_ended, function_parses, generate
from tinyloop.train.evaluate import (
    bits_per_byte,
    bpb_by_loops,
    engine_from_flat,
    eval_windows,
    evaluate_model_file,
)
from tinyloop.train.tiny_config import TEST_TINY_TRAIN_CONFIG


def test_bits_per_byte_by_hand() -> None:
    windows = torch.tensor([[1, 2, 3]], dtype=torch.uint8)
    logits = torch.full((1, 2, 256), -1e9)
    logits[0, 0, :4] = 0.0  # target 2 among 4 equal choices: 2 bits
    logits[0, 1, 3] = math.log(3.0)  # target 3 with p = 3 / (3 + 3 * 1) = 1/2: 1 bit
    logits[0, 1, 4:7] = 0.0
    assert bits_per_byte(lambda t: logits, windows) == pytest.approx(1.5, abs=1e-6)
    uniform = torch.zeros(1, 2, 256)
    assert bits_per_byte(lambda t: uniform, windows) == pytest.approx(8.0, abs=1e-6)


def test_eval_windows_are_fixed_and_disjoint() -> None:
    data = bytes(range(256)) * 10  # 2560 bytes
    w = eval_windows(data, 4, 99)
    assert w.shape == (4, 100)
    assert w[0, 0] == 0 and w[-1, -1] == data[-1]
    starts = [round(i * (len(data) - 100) / 3) for i in range(4)]
    assert all(b - a >= 100 for a, b in zip(starts, starts[1:], strict=False))
    assert torch.equal(w, eval_windows(data, 4, 99))
    assert eval_windows(data, 100, 99).shape[0] == len(data) // 100
    with pytest.raises(ValueError):
        eval_windows(b"abc", 1, 10)


def test_sweep_matches_engine_step() -> None:
    cfg = TEST_TINY_TRAIN_CONFIG
    engine = engine_from_flat(cfg, random_flat_weights(cfg, 3), "cpu")
    windows = torch.randint(0, 256, (3, 33), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    swept = bpb_by_loops(engine, windows, [1, 3, 5], batch=2)
    for n in (1, 3, 5):
        direct = bits_per_byte(lambda t, n=n: engine.step(t, None, n).logits, windows, batch=2)
        assert swept[n] == pytest.approx(direct, rel=1e-6)


COMPLETE = "    total = 0\n    for x in items:\n        total += x\n    return total\n\ndef other():\n"


def test_parse_rule_by_hand() -> None:
    header = "def add(items):"
    assert function_parses(header, COMPLETE)
    assert function_parses(header, "    return 1\n    x = (")  # the partial last line is dropped
    assert function_parses(header, '    """Doc."""\n\n    return 1\n')
    assert not function_parses(header, "    return f(1,\n             2")  # cut mid-statement
    assert not function_parses(header, '    """Unterminated\n    doc\n')
    assert not function_parses(header, "    return 1")  # no complete line
    assert not function_parses(header, "x = 1\n")  # no body
    assert not function_parses(header, "\n\n")
    assert not function_parses(header, "    return )\n")
    assert function_parses(header, "    return 1\n\x00    garbage (\n")  # NUL ends the file
    assert body_lines(COMPLETE) == COMPLETE.split("\n")[:5]


def test_function_ended() -> None:
    assert not function_ended(b"    return 1\n")
    assert not function_ended(b"    return 1\n\n")
    assert not function_ended(b"    return 1\ndef")
    assert function_ended(b"    return 1\n\ndef f():\n")
    assert function_ended(b"    x\x00")


def test_find_headers_round_robin_and_prompt() -> None:
    pre = b"".join(b"# comment line %03d\n" % i for i in range(40))
    a = pre + b"def one(x):\n    return x\n\ndef two(y):\n    pass\n    def nested(z):\n"
    b = b"import os\n\ndef three():\n    pass\nclass K:\n    def method(self):\n"
    hs = find_headers([("a.py", a), ("b.py", b)], count=3, context=300)
    assert [(h.relpath, h.def_line) for h in hs] == [
        ("a.py", "def one(x):"),
        ("b.py", "def three():"),
        ("a.py", "def two(y):"),
    ]
    assert hs[1].prompt == b"import os\n\ndef three():\n"
    assert hs[0].prompt.endswith(b"def one(x):\n") and len(hs[0].prompt) <= 300 + len(b"def one(x):\n")
    assert hs[0].prompt.startswith(b"# comment line")  # whole lines only


def test_generate_is_seeded_and_batched() -> None:
    cfg = TEST_TINY_TRAIN_CONFIG
    engine = engine_from_flat(cfg, random_flat_weights(cfg, 4), "cpu")
    prompts = [b"def f(x):\n", b"import os\n\n\ndef "]
    first = generate(engine, prompts, 2, 20, [1, 2])
    assert first == generate(engine, prompts, 2, 20, [1, 2])
    assert [len(t) for t in first] == [20, 20]
    assert generate(engine, prompts, 2, 20, [1, 3])[1] != first[1]


def test_evaluate_model_file_writes_report(corpus_dir: Path, tmp_path: Path) -> None:
    from tinyloop.convert.weight_shards import save_weight_shards
    from tinyloop.format.writer import write_model

    cfg = TEST_TINY_TRAIN_CONFIG
    flat = random_flat_weights(cfg, 5)
    model = tmp_path / "m.tinyloop"
    write_model(model, cfg, flat, bits=4, group_size=64, progress=False)
    save_weight_shards(tmp_path, cfg, flat)
    out = tmp_path / "eval"
    report = evaluate_model_file(
        model,
        corpus_dir,
        out,
        float_weights=tmp_path,
        windows=2,
        seq_len=64,
        loops=[1, 2],
        headers=3,
        sample_bytes=16,
        parse_bytes=48,
    )
    saved = json.loads((out / "eval.json").read_text())
    assert (out / "bpb_vs_loops.png").stat().st_size > 0
    assert set(saved["bpb"]["curves"]) == {"INT4", "float (fp16 weights)"}
    assert saved["parse_rate"]["headers"] == 3 and 0.0 <= report["parse_rate"]["rate"] <= 1.0
    assert len(saved["samples"]) == 6
