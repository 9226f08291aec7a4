"""`tinyloop MODEL batch` / tinyloop.jobs: each row's result equals the API called on that row alone; an
interrupted job resumes to the same output; bad rows go to the errors file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import tinyloop
from shared_data import require_module
from tinyloop.cli.main import main
from tinyloop.jobs import JobSettings
from tinyloop.jobs.local import ERRORS, iter_results, run_job
from tinyloop.jobs.tasks import TaskRunner

require_module("pyarrow")
SEQ = 128
BAD = {
    3: ({"id": "no-prompt", "max_tokens": 2}, "missing prompt"),
    57: ({"prompt": "ok", "loops": "deep"}, "loops must be an integer"),
    101: ({"prompt": 7}, "prompt must be text"),
    150: ({"prompt": "x" * (SEQ + 1)}, "too long"),
    199: ({"tokens": [1, 2, 999]}, "token ids must be in [0, 256)"),
}


@pytest.fixture(scope="module")
def model() -> tinyloop.Model:
    return tinyloop.Model("tiny", max_seq_len=SEQ)


def mixed_rows(n: int) -> list[dict]:
    """Rows with per-row settings of every kind (text, token ids, depths, greedy, seeded and unseeded
    sampling), a few bad ones among them."""
    rng = np.random.default_rng(7)
    words = ["The loop ", "Once upon a time", "A looped model", "x = 3;", "Zebra "]
    rows: list[dict] = []
    for i in range(n):
        if i in BAD:
            rows.append(BAD[i][0])
            continue
        row: dict = {"id": f"r{i}"}
        if i % 6 == 5:
            row["tokens"] = rng.integers(32, 127, size=int(rng.integers(2, 9))).tolist()
        else:
            row["prompt"] = words[i % len(words)] + str(i)
        if i % 2:
            row["max_tokens"] = int(rng.integers(0, 4))
        if i % 3 == 1:
            row["loops"] = int(rng.integers(1, 5))
        if i % 4 == 2:
            row["temperature"] = 0.9
            if i % 8 == 2:
                row["seed"] = 1000 + i
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def expected_generation(model: tinyloop.Model, index: int, row: dict, settings: JobSettings) -> list[int]:
    prompt = row.get("tokens") or list(row["prompt"].encode("utf-8"))
    temperature = row.get("temperature", settings.temperature)
    seed = row.get("seed", settings.seed + index if temperature > 0 else None)
    max_tokens, loops = row.get("max_tokens", settings.max_tokens), row.get("loops", settings.loops)
    out = model.generate(np.asarray(prompt, np.int32), max_tokens, loops, temperature, settings.top_k, 1.0, seed)
    return out.tolist()


def test_200_mixed_rows_equal_generate_row_by_row_and_bad_rows_go_to_the_errors_file(model, tmp_path) -> None:
    rows = mixed_rows(200)
    settings = JobSettings(max_tokens=3, loops=2, max_batch=8)
    summary = run_job(model, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", settings,
                      shard_rows=64, progress=False)  # fmt: skip
    assert (summary.rows, summary.results, summary.errors) == (200, 195, 5)
    results = list(iter_results(tmp_path / "out"))
    assert [r["row"] for r in results] == [i for i in range(200) if i not in BAD]
    for r in results:
        expected = expected_generation(model, r["row"], rows[r["row"]], settings)
        assert r["tokens"] == expected, r
        assert r["text"] == bytes(expected).decode("utf-8", errors="replace")
        assert r["id"] == f"r{r['row']}" and r["loops"] == rows[r["row"]].get("loops", 2)
    errors = [json.loads(line) for line in (tmp_path / "out" / ERRORS).read_text().splitlines()]
    assert [e["row"] for e in errors] == sorted(BAD)
    for e in errors:
        assert BAD[e["row"]][1] in e["reason"], e
    assert errors[0]["id"] == "no-prompt"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_sized_to_the_rows_give_what_each_row_gives_alone(dtype: torch.dtype) -> None:
    """The job's slots hold its rows' prompt + max_tokens (rounded up to the span bucket), not the model's
    max_seq_len: 8-row steps over rows whose attended spans cross several buckets equal generate alone."""
    model = tinyloop.Model("tiny", max_seq_len=256, dtype=dtype)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 256, int(n)).tolist() for n in rng.integers(9, 70, 9)]
    runner = TaskRunner(model, JobSettings(max_tokens=12, loops=2, max_batch=8))
    try:
        results, errors = runner.run([(i, {"tokens": p}) for i, p in enumerate(prompts)])
        assert errors == [] and runner._scheduler_seq == -(-(max(map(len, prompts)) + 12) // 16) * 16 < 256
        alone = [model.generate(np.asarray(p, np.int32), 12, 2, 0.0).tolist() for p in prompts]
    finally:
        runner.close()
        model.close()
    assert [r["tokens"] for r in results] == alone


def test_interrupted_job_resumes_to_the_same_output(model, tmp_path) -> None:
    rows = mixed_rows(40)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    settings = JobSettings(max_tokens=2, loops=2)
    run_job(model, source, tmp_path / "whole", settings, shard_rows=10, progress=False)
    with pytest.raises(RuntimeError, match="injected failure after 2"):
        run_job(model, source, tmp_path / "cut", settings, shard_rows=10, progress=False, fail_after_shards=2)
    assert sorted(p.name for p in (tmp_path / "cut").glob("part-*")) == ["part-00000.parquet", "part-00001.parquet"]
    with pytest.raises(FileExistsError, match="--resume"):
        run_job(model, source, tmp_path / "cut", settings, shard_rows=10, progress=False)
    with pytest.raises(ValueError, match="different job"):
        run_job(model, source, tmp_path / "cut", JobSettings(max_tokens=3), shard_rows=10, resume=True, progress=False)
    summary = run_job(model, source, tmp_path / "cut", settings, shard_rows=10, resume=True, progress=False)
    assert summary.skipped_shards == 2
    assert list(iter_results(tmp_path / "cut")) == list(iter_results(tmp_path / "whole"))
    assert (tmp_path / "cut" / ERRORS).read_text() == (tmp_path / "whole" / ERRORS).read_text()


def test_scoring_tasks_equal_the_introspection_api(model, tmp_path) -> None:
    rows = [{"prompt": "The loop runs"}, {"prompt": "The loop stops", "loops": 3}, {"tokens": [72, 105, 33, 32]},
            {"prompt": "x"}]  # fmt: skip
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    ids = [np.frombuffer(text, np.uint8).astype(np.int32) for text in (b"The loop runs", b"The loop stops", b"Hi! ")]
    loops = [4, 3, 4]
    out = {}
    for task in ("score", "lens", "uncertainty"):
        summary = run_job(model, source, tmp_path / task, JobSettings(task=task, loops=4), progress=False)
        assert (summary.results, summary.errors) == (3, 1)
        out[task] = list(iter_results(tmp_path / task))
    for i, (tokens, depth) in enumerate(zip(ids, loops, strict=True)):
        lp = model.score_token_logprobs(tokens, depth).logprob[0]
        np.testing.assert_allclose(out["score"][i]["logprobs"], lp, rtol=1e-6, atol=1e-6)
        assert out["score"][i]["loglik"] == pytest.approx(lp.sum(), abs=1e-5)
        lens = model.score_logit_lens(tokens, depth)
        assert out["lens"][i]["top1"] == lens.argmax(-1).tolist()
        p = np.exp(lens.astype(np.float64) - lens.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(out["lens"][i]["entropy"], -(p * np.log(p)).sum(-1), rtol=1e-4, atol=1e-5)
        unc = model.score_with_uncertainty(tokens, depth)
        np.testing.assert_allclose(out["uncertainty"][i]["kl"], unc.kl, rtol=1e-4, atol=1e-6)
        assert out["uncertainty"][i]["exit_depth"] == model.score_with_consistency(tokens, depth).stable_depth.tolist()
    error = json.loads((tmp_path / "score" / ERRORS).read_text())
    assert error["row"] == 3 and "at least 2 prompt tokens" in error["reason"]


def test_cli_writes_parquet_from_parquet_and_errors_are_one_line(tmp_path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"prompt": "Hi", "id": 1}, {"prompt": "Yo", "id": 2}]), tmp_path / "in.parquet"
    )
    out = tmp_path / "out"
    argv = ["tiny", "batch", str(tmp_path / "in.parquet"), str(out), "--max-tokens", "2", "--loops", "2",
            "--no-progress", "--max-seq-len", "64"]  # fmt: skip
    assert main(argv) == 0
    assert [r["id"] for r in iter_results(out)] == ["1", "2"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()  # refused before the model loads
    assert err.count("\n") == 0 and "already holds a job; pass --resume" in err
    assert main(["tiny", "batch", str(tmp_path / "missing.jsonl"), str(tmp_path / "o2"), "--no-progress"]) == 1
    assert "no such input file" in capsys.readouterr().err


def test_cli_job_killed_after_its_first_shard_resumes_to_the_same_output(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    source = write_jsonl(tmp_path / "in.jsonl", mixed_rows(24))
    options = ["--max-tokens", "6", "--loops", "2", "--shard-rows", "4", "--no-progress", "--max-seq-len", "64"]
    env = {**os.environ, "PYTHONPATH": str(Path(tinyloop.__file__).parents[1])}

    def batch(out: str, *extra: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "tinyloop.cli.main", "tiny", "batch", str(source), str(tmp_path / out)]
        return subprocess.Popen([*argv, *options, *extra], env=env, stderr=subprocess.PIPE)

    job = batch("cut")
    deadline = time.monotonic() + 120
    while not (tmp_path / "cut" / "part-00000.parquet").exists():
        assert job.poll() is None and time.monotonic() < deadline, "the job ended or stalled before its first shard"
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait(30)
    assert not (tmp_path / "cut" / "part-00005.parquet").exists()  # it really stopped mid-way
    assert batch("cut", "--resume").wait(120) == 0
    assert batch("whole").wait(120) == 0
    assert list(iter_results(tmp_path / "cut")) == list(iter_results(tmp_path / "whole"))
    assert (tmp_path / "cut" / ERRORS).read_text() == (tmp_path / "whole" / ERRORS).read_text()
    assert not [p.name for p in (tmp_path / "cut").rglob("*.tmp")]  # the killed write's temporary file is gone
