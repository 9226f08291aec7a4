"""Programmatic dependent launch inside Triton kernels: the wait on the previous kernel's results."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _wait_for_previous_kernel(PDL: tl.constexpr):
    """With PDL this kernel may start before the previous one ends: wait here until its writes are visible,
    then let the next kernel start early in turn. Everything read or written before this call must not
    depend on the previous kernel. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
