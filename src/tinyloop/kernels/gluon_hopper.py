"""The Gluon (Triton's explicit-layout dialect) Hopper modules the staged GEMV (asynchronous copies) and the
warpgroup INT4 kernel (wgmma) use, imported once;
where the installed Triton lacks them the names are None and the import error says why (Gluon is experimental:
these modules move between Triton releases)."""

from __future__ import annotations

try:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

    HOPPER_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    fence_async_shared = mbarrier = tma = warpgroup_mma = None
    HOPPER_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
