"""Fitting the number of training steps into a wall-clock budget from measured step times."""

from __future__ import annotations

from dataclasses import dataclass

from tinyloop.config import ArchConfig
from tinyloop.train.schedule import loop_count, step_units


@dataclass
class Plan:
    """total_steps None: not planned yet (time-budget runs plan after their first measured steps)."""

    total_steps: int | None
    warmup_steps: int
    sec_per_unit: float | None = None
    from_time: bool = False


def seconds_per_unit(samples: list[tuple[float, float]]) -> float:
    """samples: (units, seconds) of measured steps."""
    units = sum(u for u, _ in samples)
    return sum(s for _, s in samples) / max(units, 1e-9)


def steps_that_fit(
    cfg: ArchConfig,
    seed: int,
    first_step: int,
    seconds: float,
    sec_per_unit: float,
    mean_loops: float,
    max_loops: int,
    grad_loops: int,
    cap: int | None,
) -> int:
    """The step index (exclusive end) reached by running from first_step for `seconds`, predicting each
    step's time from its own loop count (known in advance: it is a function of seed and step)."""
    step, used = first_step, 0.0
    limit = cap if cap is not None else first_step + 10_000_000
    while step < limit:
        n = loop_count(seed, step, mean_loops, 1, max_loops)
        cost = step_units(cfg, n, grad_loops) * sec_per_unit
        if used + cost > seconds:
            break
        used += cost
        step += 1
    return step


def eval_units(cfg: ArchConfig, loops: list[int], windows: int, batch: int) -> float:
    """Cost of one bits-per-byte sweep in training-step units (a window is one batch row)."""
    edge = (cfg.n_prelude + cfg.n_coda) / cfg.n_body
    return sum(n + edge for n in loops) * windows / max(batch, 1)
