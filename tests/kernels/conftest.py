"""Kernel tests run the Triton kernels in Triton's CPU interpreter; Triton missing: a failure on CI, else a skip."""

from __future__ import annotations

from shared_data import require_module

require_module("triton")
