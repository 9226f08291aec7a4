"""Batch tasks over Ray Data: a stateful predictor (the model loads once per actor) running the same
TaskRunner as the local job, and `run_ray_job`, the `tinyloop MODEL batch --ray` driver."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tinyloop.api.model import Model
from tinyloop.format.atomic import atomic_output
from tinyloop.jobs.local import ERRORS, JobSummary, read_rows
from tinyloop.jobs.tasks import JobSettings, TaskRunner, is_missing, output_schema

# run_ray_job ships each input row as JSON text in this column (rows of any shape, including bad ones,
# fit one Arrow type), next to its index in `row`.
RECORD = "_record"
DEFAULT_BATCH_ROWS = 64


class TinyLoopPredictor:
    """`ds.map_batches(TinyLoopPredictor, fn_constructor_kwargs={"model": "tiny", "task": "score"},
    concurrency=N, num_gpus=G, batch_size=B, batch_format="pyarrow")`.

    Each batch's rows are those of the local job (a `prompt` or `tokens` column, optional max_tokens,
    loops, temperature, seed, id, and `row`, the row's global index: without it, the position in the
    batch). Returns a pyarrow table: `output_schema(task)` plus `error` (null, or why the row failed,
    its result columns then null). model_options go to tinyloop.Model; the rest to JobSettings."""

    def __init__(self, model: str, task: str = "generate", model_options: Mapping[str, Any] | None = None,
                 **settings: Any) -> None:  # fmt: skip
        self.model = Model(model, **dict(model_options or {}))
        self.runner = TaskRunner(self.model, JobSettings(task=task, **settings))
        self.schema = output_schema(task)

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        rows = _batch_rows(batch)
        records = []
        for position, row in enumerate(rows):
            index = row.pop("row", None)
            record = _decode(row[RECORD]) if RECORD in row else row
            records.append((position if is_missing(index) else int(index), record))
        results, errors = self.runner.run(records)
        out = [r | {"error": None} for r in results] + [{"row": e["row"], "id": e["id"], "error": e["reason"]}
                                                          for e in errors]  # fmt: skip
        out.sort(key=lambda r: r["row"])
        return pa.Table.from_pylist(out, schema=self.schema.append(pa.field("error", pa.string())))

    def __del__(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()


def run_ray_job(
    model: str,
    input_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    settings: JobSettings,
    *,
    model_options: Mapping[str, Any] | None = None,
    replicas: int = 1,
    num_gpus: float = 0.0,
    address: str | None = None,
    batch_rows: int = DEFAULT_BATCH_ROWS,
) -> JobSummary:
    """`tinyloop MODEL batch --ray`: the rows of `input_path` through `replicas` predictor actors; results
    written by Ray Data as Parquet files in `out_dir` (a new or empty folder), bad rows to
    out_dir/_errors.jsonl. Joins the cluster at `address` (else RAY_ADDRESS, else starts a local one)
    unless Ray is already initialized."""
    import ray

    start = time.perf_counter()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: a Ray job writes a new or empty folder; choose another")
    rows = read_rows(input_path)
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    items = [{"row": i, RECORD: json.dumps(r, default=_encode)} for i, r in enumerate(rows)]
    ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items), 4 * replicas)))
    kwargs = {"model": model, "task": settings.task, "model_options": dict(model_options or {})}
    kwargs |= {k: v for k, v in vars(settings).items() if k != "task"}
    pool = ray.data.ActorPoolStrategy(size=replicas)
    done = ds.map_batches(TinyLoopPredictor, fn_constructor_kwargs=kwargs, compute=pool, num_gpus=num_gpus,
                          batch_size=batch_rows, batch_format="pyarrow").materialize()  # fmt: skip
    results = done.map_batches(_results, batch_format="pyarrow")
    out.mkdir(parents=True, exist_ok=True)
    results.write_parquet(str(out))
    errors = sorted(done.map_batches(_errors, batch_format="pyarrow").take_all(), key=lambda r: r["row"])
    with atomic_output(out / ERRORS) as tmp:
        text = "".join(json.dumps({"row": e["row"], "id": e["id"], "reason": e["error"]}) + "\n" for e in errors)
        tmp.write_text(text, encoding="utf-8")
    return JobSummary(len(rows), len(rows) - len(errors), len(errors), 0, 0, time.perf_counter() - start)


def _results(table: Any) -> Any:
    import pyarrow.compute as pc

    return table.filter(pc.is_null(table["error"])).drop_columns(["error"])


def _errors(table: Any) -> Any:
    import pyarrow.compute as pc

    return table.filter(pc.is_valid(table["error"])).select(["row", "id", "error"])


def _batch_rows(batch: Any) -> list[dict[str, Any]]:
    """A Ray Data batch (pyarrow table, pandas frame or dict of numpy arrays) as plain Python rows."""
    if hasattr(batch, "to_pylist"):
        return list(batch.to_pylist())
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):
        return [{k: _plain(v) for k, v in r.items()} for r in batch.to_dict("records")]
    columns = {k: list(v) for k, v in batch.items()}
    n = len(next(iter(columns.values()), []))
    return [{k: _plain(v[i]) for k, v in columns.items()} for i in range(n)]


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    return {"__type__": type(value).__name__}  # refused by the row check as a wrong type, not a crash


def _decode(text: str) -> dict[str, Any]:
    def hook(obj: dict[str, Any]) -> Any:
        return base64.b64decode(obj["__bytes__"]) if set(obj) == {"__bytes__"} else obj

    value = json.loads(text, object_hook=hook)
    return value if isinstance(value, dict) else {"_bad": "the row is not an object"}
