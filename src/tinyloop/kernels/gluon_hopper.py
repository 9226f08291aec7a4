"""The Gluon (Triton's explicit-layout dialect) tensor-core and asynchronous-copy modules the GPU kernels use,
imported once; where the installed Triton lacks them the names are None and the import error says why (Gluon is
experimental: these modules move between Triton releases)."""

from __future__ import annotations

try:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HOPPER_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    HOPPER_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

try:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    MMA_V2_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    mma_v2 = None
    MMA_V2_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
