"""Depth sweeps through lm-evaluation-harness: every task at several loop counts, one table and one plot per
task (metric vs loops, with the mean exit depth when an exit rule is on).

The depths share one model and one scorer (`TinyLoopLM.sweep`): each log-likelihood request is scored at
every depth from one forward at the deepest, so the shallower depths cost only their exit path.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Tasks come from local files: nothing may be downloaded while evaluating.
for _name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")

import lm_eval  # noqa: E402

from tinyloop.integrations.lm_eval import TinyLoopLM, task_manager  # noqa: E402


@dataclass
class SweepResult:
    """metrics[task][loops] = {metric: value} (lm-eval's names without ',none'); exit_depth[task][loops]:
    the mean depth read per token when an exit rule is on; seconds: wall time of the whole sweep."""

    model: str
    depths: tuple[int, ...]
    tasks: tuple[str, ...]
    exit_rule: str | None
    metrics: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    exit_depth: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "loops": list(self.depths),
            "exit_rule": self.exit_rule,
            "seconds": round(self.seconds, 3),
            "tasks": {
                task: {str(d): dict(by_depth[d], **self._exit(d)) for d in self.depths}
                for task, by_depth in self.metrics.items()
            },
        }

    def _exit(self, depth: int) -> dict[str, float]:
        value = self.exit_depth.get(depth)
        if self.exit_rule is None or value is None or math.isnan(value):
            return {}
        return {"mean_exit_depth": round(value, 4)}


def run_sweep(
    pretrained: str,
    tasks: Sequence[str],
    depths: Sequence[int] | None,
    *,
    limit: int | None = None,
    include_path: str | Path | None = None,
    **model_args: Any,
) -> SweepResult:
    """Evaluate `tasks` at each depth (None: the model's default); model_args as TinyLoopLM's
    (batch_size, exit_criterion, ...)."""
    start = time.perf_counter()
    manager = task_manager(include_path)
    if any(t not in manager.all_tasks for t in tasks):
        manager = task_manager(include_path, include_defaults=True)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise ValueError(f"unknown task(s) {missing}; shipped local tasks: {_local_tasks()}")
    backends = TinyLoopLM.sweep(depths, pretrained, **model_args)
    # lm-eval warns on every task load that custom_dataset takes --metadata: not a problem here.
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    rule = backends[0].scorer.exit_criterion
    result = SweepResult(str(pretrained), tuple(b.loops for b in backends), tuple(tasks), rule)
    for backend in backends:
        out = lm_eval.simple_evaluate(
            model=backend, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=False,
            bootstrap_iters=0,
        )  # fmt: skip
        assert out is not None
        for task in tasks:
            values = {
                name.split(",")[0]: float(value)
                for name, value in out["results"][task].items()
                if isinstance(value, (int, float)) and "_stderr" not in name and name != "sample_len"
            }
            result.metrics.setdefault(task, {})[backend.loops] = values
        result.exit_depth[backend.loops] = backend.mean_exit_depth
    result.seconds = time.perf_counter() - start
    return result


def format_table(result: SweepResult, task: str) -> str:
    """A Markdown table: one row per depth, one column per metric (and the mean exit depth)."""
    by_depth = result.metrics[task]
    names = sorted({n for values in by_depth.values() for n in values})
    with_exit = result.exit_rule is not None
    header = ["loops", *names] + (["mean exit depth"] if with_exit else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for depth in result.depths:
        cells = [str(depth)] + [f"{by_depth[depth].get(n, float('nan')):.4f}" for n in names]
        if with_exit:
            cells.append(f"{result.exit_depth.get(depth, float('nan')):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(result: SweepResult, task: str, path: str | Path) -> None:
    """Metric vs loops for one task (PNG); the mean exit depth on a second axis when an exit rule is on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_depth = result.metrics[task]
    names = sorted({n for values in by_depth.values() for n in values})
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in names:
        ax.plot(result.depths, [by_depth[d].get(name, float("nan")) for d in result.depths], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(result.depths)
    ax.set_xticklabels([str(d) for d in result.depths])
    ax.set_xlabel("loops")
    ax.set_ylabel("metric")
    ax.set_title(f"{task}: {Path(result.model).name}")
    ax.grid(alpha=0.3)
    if result.exit_rule is not None:
        twin = ax.twinx()
        twin.plot(result.depths, [result.exit_depth[d] for d in result.depths], "k--", marker="s", label="exit depth")
        twin.set_ylabel(f"mean exit depth ({result.exit_rule})")
        twin.legend(loc="lower right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_json(result: SweepResult, path: str | Path) -> None:
    """The results as JSON, written to a temporary file first so a failure leaves no half-written file."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    tmp.replace(target)


def _local_tasks() -> list[str]:
    from tinyloop.integrations.lm_eval import TASKS_DIR

    return sorted(p.stem for p in TASKS_DIR.glob("*/*.yaml"))
