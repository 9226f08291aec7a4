"""Every TINYLOOP_* environment variable, read and typed in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def log_level() -> int:
    """TINYLOOP_LOG_LEVEL: 0 quiet, 1 default, 2 verbose; anything else (or unparsable) means 1."""
    raw = os.environ.get("TINYLOOP_LOG_LEVEL", "").strip()
    try:
        level = int(raw)
    except ValueError:
        return 1
    return level if 0 <= level <= 2 else 1


@dataclass(frozen=True)
class RuntimeEnv:
    """Switches read when a Model is created."""

    disable_kv_cache: bool
    kv_int8: bool
    kv_h_mode: bool
    fp16_body: bool
    disable_cublas_fp16: bool
    disable_pdl: bool
    disable_gluon_gemv: bool
    disable_staged_gemv: bool
    disable_tinygemm: bool
    disable_mma_int4: bool
    persistent_decode: bool
    batch_invariant: bool
    disable_flash2_prefill: bool
    disable_l2_residency: bool
    use_cudnn_sdpa: bool
    cross_iter_round: bool
    cuda_profile: bool
    token_exit: int
    token_exit_verbose: bool

    @classmethod
    def read(cls) -> RuntimeEnv:
        token_exit = _int("TINYLOOP_TOKEN_EXIT", 0)
        if token_exit < 0:
            raise ValueError(f"TINYLOOP_TOKEN_EXIT must be >= 0, got {token_exit}")
        return cls(
            disable_kv_cache=_flag("TINYLOOP_DISABLE_KV_CACHE"),
            kv_int8=_flag("TINYLOOP_KV_INT8"),
            kv_h_mode=_flag("TINYLOOP_KV_H_MODE"),
            fp16_body=_flag("TINYLOOP_EXPERIMENTAL_FP16_BODY"),
            disable_cublas_fp16=_flag("TINYLOOP_DISABLE_CUBLAS_FP16"),
            disable_pdl=_flag("TINYLOOP_DISABLE_PDL"),
            disable_gluon_gemv=_flag("TINYLOOP_DISABLE_GLUON_GEMV"),
            disable_staged_gemv=_flag("TINYLOOP_DISABLE_STAGED_GEMV"),
            disable_tinygemm=_flag("TINYLOOP_DISABLE_TINYGEMM"),
            disable_mma_int4=_flag("TINYLOOP_DISABLE_MMA_INT4"),
            persistent_decode=_flag("TINYLOOP_PERSISTENT_DECODE"),
            batch_invariant=_flag("TINYLOOP_BATCH_INVARIANT"),
            disable_flash2_prefill=_flag("TINYLOOP_DISABLE_FLASH2_PREFILL"),
            disable_l2_residency=_flag("TINYLOOP_DISABLE_L2_RESIDENCY"),
            use_cudnn_sdpa=_flag("TINYLOOP_USE_CUDNN_SDPA"),
            cross_iter_round=_flag("TINYLOOP_CROSS_ITER_ROUND"),
            cuda_profile=_flag("TINYLOOP_CUDA_PROFILE"),
            token_exit=token_exit,
            token_exit_verbose=_flag("TINYLOOP_TOKEN_EXIT_VERBOSE"),
        )
