"""Refuse allocations that cannot fit, before they happen (host memory can over-commit silently)."""

from __future__ import annotations

import torch

from tinyloop.errors import OutOfMemoryError


def available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(device: torch.device, nbytes: int) -> None:
    """Raise OutOfMemoryError when a CPU buffer of nbytes would not fit in available memory."""
    if device.type != "cpu":
        return
    free = available_host_bytes()
    if free is not None and nbytes > free:
        raise OutOfMemoryError(f"{nbytes / 2**20:.0f} MiB needed for buffers, {free / 2**20:.0f} MiB available")
