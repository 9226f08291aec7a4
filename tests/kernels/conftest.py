"""Kernel tests run the Triton kernels in Triton's CPU interpreter; Triton missing: a failure on CI, else a skip."""

from __future__ import annotations

import pytest

from shared_data import require_module

require_module("triton")


@pytest.fixture(autouse=True)
def _big_interpreter_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter runs each program separately: few, large tiles keep the tests quick."""
    from tinyloop.kernels import cuda_ops

    monkeypatch.setattr(cuda_ops, "_matvec_config", lambda n, k, rows, group: (32, max(group, 64), 4))
