"""`run_job`: a batch job on one machine — input rows in shards, each shard's results published atomically
as OUT/part-NNNNN.parquet, so `resume=True` skips finished shards and never duplicates or loses a row.

OUT is a folder: part-*.parquet (results, sorted by input row), _errors.jsonl (bad rows: row, id, reason)
and _job.json (what the job is, checked on resume). Names starting with '_' are skipped by Parquet
readers, so `pyarrow.parquet.read_table(OUT)` reads the results alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tinyloop.api.model import Model
from tinyloop.format.atomic import atomic_output
from tinyloop.jobs.tasks import JobSettings, TaskRunner, output_schema

MANIFEST = "_job.json"
ERRORS = "_errors.jsonl"
SHARD_ERRORS = "_errors"  # one JSONL per finished shard, joined into ERRORS when the job ends


@dataclass(frozen=True)
class JobSummary:
    rows: int
    results: int
    errors: int
    skipped_shards: int
    generated_tokens: int
    seconds: float


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The input's rows as dicts: JSONL (.jsonl/.json, one object per line) or Parquet (.parquet/.pq).
    A JSONL line that is not an object becomes {"_bad": reason} (an error row, not a failed job)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such input file")
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if suffix not in (".jsonl", ".json", ".ndjson"):
        raise ValueError(f"{p}: the input must be JSONL (.jsonl) or Parquet (.parquet), got {suffix or 'no suffix'}")
    rows: list[dict[str, Any]] = []
    with open(p, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                value = {"_bad": f"line {number} is not JSON ({exc.msg})"}
            rows.append(value if isinstance(value, dict) else {"_bad": f"line {number} is not a JSON object"})
    return rows


def run_job(
    model: Model,
    input_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    settings: JobSettings,
    *,
    shard_rows: int = 256,
    resume: bool = False,
    progress: bool = True,
    fail_after_shards: int | None = None,
) -> JobSummary:
    """Run `settings.task` over every row of `input_path` into the folder `out_dir` (see the module doc).

    Raises FileExistsError when out_dir already holds a job and resume is False, ValueError when resume
    finds a different job there. fail_after_shards (tests): raise after publishing that many shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if shard_rows < 1:
        raise ValueError(f"shard_rows must be a positive integer, got {shard_rows}")
    start = time.perf_counter()
    rows = read_rows(input_path)
    out = Path(out_dir)
    manifest = {"input": str(Path(input_path).resolve()), "rows": len(rows), "shard_rows": shard_rows,
                "model": model.cache_identity, "settings": asdict(settings)}  # fmt: skip
    _prepare(out, manifest, resume)
    shards = range(0, len(rows), shard_rows)
    runner = TaskRunner(model, settings)
    schema = output_schema(settings.task)
    bar = _progress(len(rows), progress)
    done = skipped = published = 0
    try:
        for k, first in enumerate(shards):
            part = out / f"part-{k:05d}.parquet"
            size = min(shard_rows, len(rows) - first)
            if part.exists():  # published, so complete (written under a temporary name, then renamed)
                skipped += 1
                bar.update(size)
                continue
            records = [(first + i, rows[first + i]) for i in range(size)]
            results, errors = runner.run(records)
            with atomic_output(out / SHARD_ERRORS / f"{k:05d}.jsonl") as tmp:
                tmp.write_text("".join(json.dumps(e) + "\n" for e in errors), encoding="utf-8")
            with atomic_output(part) as tmp:
                pq.write_table(pa.Table.from_pylist(results, schema=schema), tmp)
            done += len(results)
            published += 1
            bar.update(size)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{runner.generated_tokens / elapsed:.1f} tok/s", refresh=False)
            if fail_after_shards is not None and published >= fail_after_shards:
                raise RuntimeError(f"injected failure after {published} shard(s)")
    finally:
        bar.close()
        runner.close()
    n_errors = _join_errors(out, len(shards))
    return JobSummary(len(rows), _count_results(out), n_errors, skipped, runner.generated_tokens,
                      time.perf_counter() - start)  # fmt: skip


def _prepare(out: Path, manifest: dict[str, Any], resume: bool) -> None:
    path = out / MANIFEST
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder (OUT is a folder of Parquet shards)")
    if path.exists():
        if not resume:
            raise FileExistsError(f"{out}: already holds a job; pass --resume to finish it, or choose a new folder")
        previous = json.loads(path.read_text(encoding="utf-8"))
        changed = [key for key in manifest if previous.get(key) != manifest[key]]
        if changed:
            raise ValueError(f"{out}: --resume found a different job there ({', '.join(changed)} changed); "
                             "run it with the same model, input and options, or choose a new folder")  # fmt: skip
        return
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out}: the folder is not empty and holds no job; choose an empty or new folder")
    (out / SHARD_ERRORS).mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def _join_errors(out: Path, shards: int) -> int:
    lines = []
    for k in range(shards):
        lines.extend((out / SHARD_ERRORS / f"{k:05d}.jsonl").read_text(encoding="utf-8").splitlines())
    with atomic_output(out / ERRORS) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)


def _count_results(out: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in sorted(out.glob("part-*.parquet")))


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="row", file=sys.stderr, disable=not enabled, dynamic_ncols=True, smoothing=0.1)


def iter_results(out_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The result rows of a finished job folder, in input order."""
    import pyarrow.parquet as pq

    for part in sorted(Path(out_dir).glob("part-*.parquet")):
        yield from pq.read_table(part).to_pylist()
