"""Per-step randomness and schedules: learning rate, loop counts, batch offsets, step cost units.

Every random draw is a pure function of (seed, step), so a resumed run replays exactly the steps an
uninterrupted run would have taken, with no generator state to save.
"""

from __future__ import annotations

import math

import numpy as np

from tinyloop.config import ArchConfig

_LOOPS_STREAM = 0x100B
_BATCH_STREAM = 0xBA7C


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to floor * peak at step `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def loop_count(seed: int, step: int, mean: float, lo: int = 1, hi: int = 16) -> int:
    """n ~ Poisson(mean) truncated to [lo, hi] (redrawn until inside), the same for the whole batch."""
    rng = np.random.default_rng([seed, step, _LOOPS_STREAM])
    for _ in range(1000):
        n = int(rng.poisson(mean))
        if lo <= n <= hi:
            return n
    return min(max(int(round(mean)), lo), hi)


def batch_offsets(seed: int, step: int, n_bytes: int, batch: int, window: int) -> np.ndarray:
    """Start offsets of `batch` windows of `window` bytes, uniform over the data."""
    if n_bytes < window:
        raise ValueError(f"training data of {n_bytes} bytes is shorter than one window of {window}")
    rng = np.random.default_rng([seed, step, _BATCH_STREAM])
    return rng.integers(0, n_bytes - window + 1, size=batch)


def step_units(cfg: ArchConfig, loops: int, grad_loops: int) -> float:
    """Relative cost of a step, in forward passes of one body iteration: no-grad iterations cost 1,
    iterations and prelude/coda layers under backprop cost about 3 (forward + backward)."""
    k = min(loops, grad_loops)
    edge = (cfg.n_prelude + cfg.n_coda) / cfg.n_body
    return (loops - k) + 3.0 * (k + edge)
