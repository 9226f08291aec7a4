"""The lm-eval backend: log-likelihoods against Model.score and the naive float64 reference, greedy
generate_until against generate, the shipped task through lm-eval's own evaluator, depth sweeps against
separate runs, and the CLI verb."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

import tinyloop
from helpers import random_flat_weights
from naive_reference import naive_forward
from shared_data import require_module
from tinyloop.cli.main import main
from tinyloop.presets import preset

lm_eval = require_module("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from tinyloop.integrations.lm_eval import NEWLINE, TinyLoopLM, task_manager  # noqa: E402

PAIRS = [
    ("def add(a, b):\n    return", " a + b\n"),
    ("import os", "\nimport sys\n"),
    ("x = [1, 2, 3]\nfor item in x:\n    print(", "item)\n"),
    ("class A(object):\n    pass", "\n"),
]
# Contexts shared by several continuations (one token long among them): each context runs once per batch.
SHARED = [("def add(a, b):\n    return", c) for c in (" a - b\n", "\n", " b")]
SHARED += [("import os", c) for c in ("\n", "x", " # the os module\n", "\nimport re\n")]


def _requests(kind: str, args: list[tuple[str, ...]]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]  # type: ignore[arg-type]


def _naive_logprob(tokens: list[int], n: int, loops: int) -> float:
    """log p of the last n tokens of `tokens` under the float64 reference of the test-tiny weights."""
    cfg = preset("test-tiny")
    logits, _, _ = naive_forward(cfg, random_flat_weights(cfg, seed=7), tokens[:-1], loops)
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(tokens[1:])
    return float(logp[torch.arange(len(tokens) - 1), targets][-n:].sum())


@pytest.fixture(scope="module")
def backend(tiny_files):
    return TinyLoopLM(str(tiny_files["f32"]), loops=3, batch_size=3)


def test_loglikelihood_equals_score_and_naive_reference(backend) -> None:
    results = backend.loglikelihood(_requests("loglikelihood", PAIRS + SHARED), disable_tqdm=True)
    for i, ((context, continuation), (lp, greedy)) in enumerate(zip(PAIRS + SHARED, results, strict=True)):
        tokens = list((context + continuation).encode())
        n = len(continuation.encode())
        logits = torch.from_numpy(backend.model.score(np.array(tokens[:-1], np.int32), loops=3)).double()
        logp = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])][-n:]
        # Rows of a batch are right-padded to one length: the padding may change a row's BLAS blocking only.
        assert lp == pytest.approx(float(logp.sum()), abs=1e-4)
        if i < len(PAIRS):  # the slow float64 reference for a few (the first two share their contexts)
            assert lp == pytest.approx(_naive_logprob(tokens, n, 3), abs=1e-3)
        argmax = logits.argmax(-1)[-n:]
        assert greedy == bool((argmax == torch.tensor(tokens[1:])[-n:]).all())


def test_rolling_loglikelihood_is_the_whole_text_after_a_newline(backend) -> None:
    text = "def f(x):\n    return x * 2\n"
    (total,) = backend.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    tokens = [NEWLINE, *text.encode()]
    assert total == pytest.approx(_naive_logprob(tokens, len(tokens) - 1, 3), abs=1e-3)


def test_greedy_generate_until_equals_generate_with_the_same_stops() -> None:
    lm = TinyLoopLM("tiny", loops=4, batch_size=2)
    contexts = ["def main():\n    ", "import os\nimport ", "class Point(object):\n    def __init__(self"]
    gen_kwargs = [{"until": ["\n"], "max_gen_toks": 24}, {"until": ["\n\n", "os"], "max_gen_toks": 16}, {}]
    gen_kwargs[2] = {"until": [":"], "max_gen_toks": 20}
    outs = lm.generate_until(_requests("generate_until", list(zip(contexts, gen_kwargs, strict=True))))
    for context, kwargs, out in zip(contexts, gen_kwargs, outs, strict=True):
        ids = lm.model.generate(
            lm.model.encode(context), kwargs["max_gen_toks"], 4, temperature=0, stop=kwargs["until"]
        )
        assert out == lm.model.decode(ids)
    assert any(outs), "the outputs must not all be empty"


def test_shipped_task_through_lm_evals_evaluator_repeats() -> None:
    runs = [
        lm_eval.simple_evaluate(
            model="tinyloop",
            model_args="pretrained=tiny,loops=2",
            tasks=["python_snippets"],
            task_manager=task_manager(),
            limit=6,
            batch_size=4,
            bootstrap_iters=0,
        )  # fmt: skip
        for _ in range(2)
    ]
    first, second = (r["results"]["python_snippets"] for r in runs)
    assert first == second
    assert 0.0 <= first["acc,none"] <= 1.0 and first["acc,none"] > 0.25  # the model beats 4-way chance


def test_depth_sweep_equals_separate_runs_at_each_depth(tiny_files) -> None:
    path = str(tiny_files["f32"])
    swept = TinyLoopLM.sweep([4, 1, 2], path, batch_size=2)
    assert [lm.loops for lm in swept] == [1, 2, 4]
    requests = _requests("loglikelihood", PAIRS + SHARED)
    for lm in swept:
        alone = TinyLoopLM(path, loops=lm.loops, batch_size=2)
        assert lm.loglikelihood(requests, disable_tqdm=True) == alone.loglikelihood(requests, disable_tqdm=True)
    assert swept[0].scorer is swept[2].scorer and len(swept[0].scorer.results) == len(PAIRS + SHARED)


def test_exit_criterion_reads_each_position_at_its_exit_depth(tiny_files) -> None:
    with tinyloop.Model(tiny_files["f32"]) as model:
        tokens = np.frombuffer(b"for i in range(10):\n    print(i)\n", dtype=np.uint8).astype(np.int32)
        lens = model.score_token_logprobs(tokens, list(range(1, 7)))
        got = model.score_token_logprobs(tokens, [3, 6], exit_criterion="kl", exit_tol=0.05)
        assert got.exit_depth.min() >= 1 and (got.exit_depth[0] <= 3).all() and (got.exit_depth[1] <= 6).all()
        assert (got.exit_depth[1] < 6).any(), "the tolerance must let some positions exit early"
        for d in range(2):
            at_exit = np.take_along_axis(lens.logprob, got.exit_depth[d][None] - 1, axis=0)[0]
            assert np.array_equal(got.logprob[d], at_exit)
        # A position that exits before depth 3 reads the same logits in both rows of the sweep.
        early = got.exit_depth[1] < 3
        assert np.array_equal(got.logprob[0][early], got.logprob[1][early])


def test_cli_sweep_writes_table_json_and_both_argument_orders(tmp_path, capsys) -> None:
    out = tmp_path / "results.json"
    argv = ["--tasks", "python_snippets", "--loops", "2,1", "--limit", "3", "--output", str(out), "--dtype", "float32"]
    assert main(["tiny", "eval", *argv]) == 0
    table = capsys.readouterr().out
    assert "| loops | acc | acc_norm |" in table and "| 1 |" in table and "| 2 |" in table
    data = json.loads(out.read_text())
    assert data["loops"] == [1, 2] and set(data["tasks"]["python_snippets"]) == {"1", "2"}
    assert main(["eval", "tiny", *argv]) == 0
    again = json.loads(out.read_text())
    assert again["tasks"] == data["tasks"]
    assert all(math.isfinite(v) for v in data["tasks"]["python_snippets"]["2"].values())


def test_cli_errors_are_one_line(capsys, monkeypatch) -> None:
    assert main(["tiny", "eval", "--tasks", "no_such_task", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown task" in err[0] and "python_snippets" in err[0]
    assert main(["tiny", "eval", "--tasks", "python_snippets", "--loops", "0,2"]) == 2
    assert "--loops" in capsys.readouterr().err
    assert main(["tiny", "eval", "--tasks", "python_snippets", "--exit-threshold", "0.5"]) == 2
    assert "needs a model with an exit gate" in capsys.readouterr().err
    for name in ("tinyloop.integrations.sweep", "tinyloop.integrations.lm_eval"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    assert main(["tiny", "eval", "--tasks", "python_snippets"]) == 1
    assert "pip install 'loopformer[eval]'" in capsys.readouterr().err
