"""Checks of the `Model` constructor's and scoring methods' arguments: each bad value is a ValueError or
TypeError that names the argument and what it accepts. Sampling arguments are `SamplingParams`' own."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tinyloop import log
from tinyloop.config import MAX_LOOPS, ArchConfig
from tinyloop.errors import ArgumentTypeError

# The compute dtypes a model runs in, by the names the CLI's --dtype takes.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_warned_cpu_float16 = False


def compute_dtype(dtype: Any, device: torch.device) -> torch.dtype | None:
    """`dtype` as a torch dtype (None or "auto": the runtime's default for the device and model).

    Accepts torch.float32 / torch.bfloat16 / torch.float16 or their names. float16 on the CPU is allowed
    (for comparing numerics with CUDA) but warned about once: the CPU has no fast float16 kernels.
    """
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *DTYPES]} (or a torch dtype), got {dtype!r}")
        dtype = DTYPES[dtype]
    elif not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(
            f"dtype must be a torch.dtype or one of {['auto', *DTYPES]}, got {type(dtype).__name__}"
        )
    if dtype not in DTYPES.values():
        names = ", ".join(f"torch.{n}" for n in DTYPES)
        raise ValueError(f"dtype must be one of {names} (or None for the default), got {dtype}")
    global _warned_cpu_float16
    if dtype == torch.float16 and device.type == "cpu" and not _warned_cpu_float16:
        _warned_cpu_float16 = True
        log.info(
            "warning: float16 on the CPU runs about 10x slower than float32 (no fast CPU float16 kernels); "
            "use float32 (the default) or bfloat16 (INT4 matmuls) unless you mean to compare numerics"
        )
    return dtype


def checked_loops(loops: Any, cfg: ArchConfig, name: str = "loops") -> int:
    """Loop iterations for a run: the model's default for None, else an integer in [1, max_loops(cfg)]."""
    if loops is None:
        return cfg.default_loops
    if isinstance(loops, bool) or not isinstance(loops, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an integer in [1, {max_loops(cfg)}] or None, got {loops!r}")
    if not 1 <= loops <= max_loops(cfg):
        raise ValueError(f"{name} must be in [1, {max_loops(cfg)}] (the runtime's maximum), got {loops}")
    return int(loops)


def max_loops(cfg: ArchConfig) -> int:
    """The most loop iterations one run of this model may ask for: MAX_LOOPS, or the model's own default
    when that is larger."""
    return max(MAX_LOOPS, cfg.default_loops)
