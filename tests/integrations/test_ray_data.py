"""Ray Data (ray.init(num_cpus=2)): the --ray batch job and TinyLoopPredictor give the local job's rows."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from shared_data import require_module

require_module("ray")
require_module("pyarrow")

import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402

import tinyloop  # noqa: E402
from tinyloop.jobs import JobSettings  # noqa: E402
from tinyloop.jobs.local import ERRORS, iter_results, run_job  # noqa: E402

SEQ = 96


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()


def rows() -> list[dict]:
    out: list[dict] = []
    for i in range(20):
        row: dict = {"id": f"r{i}", "prompt": f"Row {i}: the loop"}
        if i % 3 == 0:
            row["loops"] = 1 + i % 4
        if i % 4 == 1:
            row["temperature"] = 0.8  # unseeded: the job seeds it with its row index
        if i % 5 == 2:
            row["max_tokens"] = 1
        out.append(row)
    out[7] = {"id": "bad", "prompt": None}
    out[13]["tokens"], out[13]["prompt"] = [65, 66, 67], None
    return out


@pytest.mark.parametrize("task", ["generate", "score"])
def test_ray_job_equals_the_local_job(ray_local, tmp_path, task) -> None:
    from tinyloop.integrations.ray import run_ray_job

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows()), encoding="utf-8")
    settings = JobSettings(task=task, max_tokens=3, loops=2, max_batch=4)
    with tinyloop.Model("tiny", max_seq_len=SEQ) as model:
        run_job(model, source, tmp_path / "local", settings, shard_rows=8, progress=False)
    summary = run_ray_job("tiny", source, tmp_path / "ray", settings, model_options={"max_seq_len": SEQ}, replicas=2,
                          batch_rows=4)  # fmt: skip
    assert (summary.results, summary.errors) == (19, 1)
    remote = sorted(pq.read_table(tmp_path / "ray").to_pylist(), key=lambda r: r["row"])
    assert remote == list(iter_results(tmp_path / "local"))
    assert (tmp_path / "ray" / ERRORS).read_text() == (tmp_path / "local" / ERRORS).read_text()


def test_predictor_in_map_batches_on_a_users_dataset(ray_local) -> None:
    from tinyloop.integrations.ray import TinyLoopPredictor

    ds = ray.data.from_items([{"prompt": "The loop", "row": 0}, {"prompt": "A", "row": 1}, {"tokens": [72, 105]}])
    out = ds.map_batches(TinyLoopPredictor, fn_constructor_kwargs={"model": "tiny", "task": "score", "loops": 2,
                         "model_options": {"max_seq_len": SEQ}}, concurrency=1, batch_size=8)  # fmt: skip
    got = {r["row"]: r for r in out.take_all()}
    with tinyloop.Model("tiny", max_seq_len=SEQ) as model:
        lp = model.score_token_logprobs(list(b"The loop"), 2).logprob[0]
    assert got[0]["loglik"] == pytest.approx(float(lp.sum())) and got[0]["error"] is None
    assert "at least 2 prompt tokens" in got[1]["error"]
