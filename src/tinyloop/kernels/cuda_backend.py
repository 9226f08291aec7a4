"""Builds the kernel policy of a CUDA engine and installs its kernels behind the dispatch point."""

from __future__ import annotations

import functools
from typing import Any

import torch

from tinyloop.env import RuntimeEnv
from tinyloop.kernels.attention_backend import sdpa
from tinyloop.kernels.dispatch import (
    Weight,
    register_attention_kernel,
    register_embedding_kernel,
    register_linear_kernel,
)
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.log import info
from tinyloop.quant import Int4Weight


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _int4_linear(policy: KernelPolicy, x: torch.Tensor, w: Weight) -> torch.Tensor:
    from tinyloop.kernels.cuda_ops import fused_linear

    assert isinstance(w, Int4Weight)
    flat = x.reshape(-1, x.shape[-1])
    return fused_linear(policy, flat, w).view(*x.shape[:-1], w.shape[0])


def _int4_embedding(policy: KernelPolicy, ids: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    from tinyloop.kernels.cuda_ops import int4_rows

    assert isinstance(w, Int4Weight)
    return int4_rows(policy, ids, w, dtype)


def kernel_policy(env: RuntimeEnv) -> KernelPolicy:
    """The policy of a CUDA engine: the measured defaults, with the kernels this GPU and Triton build switched
    on unless the environment switches them off. Read once, when the engine is created."""
    triton_ok = triton_available()
    persistent = triton_ok and env.persistent_decode
    wgmma = triton_ok and not env.disable_mma_int4 and mma_int4_wgmma_supported()
    if env.batch_invariant and not wgmma:
        raise ValueError(
            "TINYLOOP_BATCH_INVARIANT=1 needs the warpgroup INT4 kernel: a Hopper GPU (compute capability 9.0), "
            "Triton with Gluon, and TINYLOOP_DISABLE_MMA_INT4 unset"
        )
    if env.batch_invariant and persistent:
        raise ValueError("TINYLOOP_BATCH_INVARIANT=1 and TINYLOOP_PERSISTENT_DECODE=1 exclude each other: choose one")
    return KernelPolicy(
        cublas_16bit=not env.disable_cublas_fp16,
        pdl=triton_ok and not env.disable_pdl and pdl_supported(),
        gluon_gemv=triton_ok and not env.disable_gluon_gemv and gluon_supported(),
        staged_gemv=triton_ok and not env.disable_staged_gemv and staged_supported(),
        sdpa_math_only=env.disable_flash2_prefill,
        sdpa_cudnn=env.use_cudnn_sdpa,
        persistent_decode=persistent,
        attention_out_max_rows=1 if persistent else 0,
        tinygemm=not env.disable_tinygemm and tinygemm_supported(),
        mma_int4=triton_ok and not env.disable_mma_int4 and mma_int4_supported(),
        mma_int4_wgmma=wgmma,
        batch_invariant=env.batch_invariant,
    )


def install(policy: KernelPolicy) -> bool:
    """Route prefill attention on CUDA as the policy says and INT4 matmuls on CUDA to the Triton kernels under
    it (the dispatch point's entries for CUDA: the engine created last decides them).

    Returns False (after saying so) when Triton is missing: INT4 weights then dequantize per call.
    """
    register_attention_kernel("cuda", functools.partial(sdpa, math_only=policy.sdpa_math_only,
                                                        cudnn=policy.sdpa_cudnn))  # fmt: skip
    if not triton_available():
        info("Triton is not installed: CUDA INT4 matmuls dequantize on every call (slow)")
        return False
    register_linear_kernel("int4", "cuda", functools.partial(_int4_linear, policy))
    register_embedding_kernel("int4", "cuda", functools.partial(_int4_embedding, policy))
    return True


def tinygemm_supported() -> bool:
    """torch's CUDA tinygemm INT4 kernel: an Ampere-or-later GPU and a torch build that has it."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        return False
    return hasattr(torch.ops.aten, "_weight_int4pack_mm") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack")


def mma_int4_supported() -> bool:
    """The tensor-core INT4 kernel of batched steps: a Hopper-or-later GPU (its decoding uses sm_90's 16-bit
    vector subtraction) and a Triton with the Gluon layouts it is written in."""
    from tinyloop.kernels import gluon_int4_mma

    return _kernel_module_usable(9, gluon_int4_mma, "the tensor-core INT4 kernel", "no Gluon MMA in this Triton")


def mma_int4_wgmma_supported() -> bool:
    """The tensor-core INT4 kernel's warpgroup version: a Hopper GPU (wgmma is sm_90's alone) and a Triton whose
    Gluon has it."""
    from tinyloop.kernels import gluon_int4_mma

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    if not gluon_int4_mma.wgmma_available():
        info("the tensor-core INT4 kernel's warpgroup version is unavailable (no Gluon wgmma in this Triton)")
        return False
    return True


def pdl_supported() -> bool:
    """Programmatic dependent launch: a Hopper-or-later GPU and a Triton that can launch with it."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def gluon_supported() -> bool:
    """The Gluon decode GEMV: an Ampere-or-later GPU and a Triton with the Gluon layouts it is written in."""
    from tinyloop.kernels import gluon_gemv

    return _kernel_module_usable(8, gluon_gemv, "the Gluon decode GEMV", "no Gluon layouts in this Triton",
                                 "; the Triton one is used")  # fmt: skip


def staged_supported() -> bool:
    """The staged decode GEMV: TMA (a Hopper-or-later GPU) and a Triton whose Gluon has it."""
    from tinyloop.kernels import gluon_gemv_staged

    return _kernel_module_usable(9, gluon_gemv_staged, "the staged decode GEMV", "no TMA copies in this Triton's Gluon")


def _kernel_module_usable(min_major: int, module: Any, what: str, missing: str, fallback: str = "") -> bool:
    """A CUDA GPU of compute capability `min_major`.x or later and a kernel module whose `available()` holds;
    says why not (the module's import error, else `missing`) when the GPU qualifies but the module does not."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < min_major:
        return False
    if not module.available():
        info(f"{what} is unavailable ({module._IMPORT_ERROR or missing}){fallback}")
        return False
    return True


def l2_cache_bytes() -> int:
    if not torch.cuda.is_available():
        return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0))
