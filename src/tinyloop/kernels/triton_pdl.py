"""Programmatic dependent launch inside Triton kernels: the wait on the previous kernel's results."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _wait_for_previous_kernel(PDL: tl.constexpr):
    """With PDL (1) this kernel may start before the previous one ends: wait here until its writes are
    visible, then let the next kernel start early in turn. PDL = 2 lets the next kernel start before the
    wait, so several kernels' prologues can run ahead of the one computing. Either way everything read
    before this call must be data no kernel of the step writes (weights, earlier cache positions, the
    positions the host wrote), and nothing may be written before it. A no-op without PDL (0)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
