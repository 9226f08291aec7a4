"""Turns a `.tinyloop` file into an Engine on a device: load, prepare weights for the kernels."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from tinyloop.config import ArchConfig
from tinyloop.env import RuntimeEnv, log_level
from tinyloop.format.header import ModelHeader, read_header
from tinyloop.format.reader import load_weights
from tinyloop.kernels import cpu_int4, cuda_backend
from tinyloop.kernels.dispatch import Weight
from tinyloop.kernels.l2_residency import L2Plan, keep_looped_resident
from tinyloop.log import info
from tinyloop.model.cross_iter import stochastic_weights
from tinyloop.model.weights import ModelWeights
from tinyloop.quant import BlockedInt4Weight, Int4Weight, Int8Weight
from tinyloop.runtime.engine import Engine, cpu_threads_for
from tinyloop.runtime.load_report import report_load
from tinyloop.stochastic.weight import CrossIterRound


def pick_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r} ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev


# Models up to this width compute in float32 on CUDA: their decode steps are bound by launches, not by
# activation bytes, so float32 costs nothing there and keeps GPU results equal to the CPU's.
FLOAT32_MAX_WIDTH = 1024


def default_dtype(device: torch.device, cfg: ArchConfig | None = None) -> torch.dtype:
    if device.type == "cpu" or (cfg is not None and cfg.d_model <= FLOAT32_MAX_WIDTH):
        return torch.float32
    return torch.bfloat16


def prepare_weights(
    flat: Mapping[str, Weight],
    device: torch.device,
    dtype: torch.dtype,
    *,
    keep_int4: bool = False,
    dense_body: bool = False,
    int4_matmuls: bool = False,
) -> dict[str, Weight]:
    """Weights on the device, ready for the kernels.

    CPU (default): quantized matrices are dequantized once here — a dense GEMM beats dequantizing every
    call. int4_matmuls (CPU, bfloat16 matmuls): INT4 matrices keep their codes for torch's CPU INT4 kernel
    instead (kernels/cpu_int4.py), with a bfloat16 copy for calls of many rows. keep_int4 (CUDA): INT4
    matrices stay packed for the Triton kernels, except the looped body's when dense_body
    (TINYLOOP_EXPERIMENTAL_FP16_BODY) asks for it in the 16-bit compute dtype.
    Vectors (norms, biases, gate) stay float32: they are tiny and precision matters there.
    """
    # One CPU thread: the work is memory-bound, and a thread pool on a busy machine costs seconds here.
    with cpu_threads_for(device, 1):
        return _prepare(flat, device, dtype, keep_int4=keep_int4, dense_body=dense_body, int4_matmuls=int4_matmuls)


def _prepare(
    flat: Mapping[str, Weight],
    device: torch.device,
    dtype: torch.dtype,
    *,
    keep_int4: bool,
    dense_body: bool,
    int4_matmuls: bool,
) -> dict[str, Weight]:
    out: dict[str, Weight] = {}
    for name, w in flat.items():
        if isinstance(w, Int4Weight) and keep_int4 and not (dense_body and name.startswith("body.")):
            out[name] = _kernel_layout(w.to(device))
            continue
        if int4_matmuls and device.type == "cpu" and isinstance(w, Int4Weight) and cpu_int4.packable(w):
            out[name] = cpu_int4.pack(w, table=name == "embed.weight")
            continue
        if device.type == "cpu" and dtype == torch.float32 and type(w) is Int4Weight and name != "embed.weight":
            out[name] = dequantize_int4_cpu(w)
            continue
        if isinstance(w, (Int4Weight, Int8Weight)):
            dense = w.to(device).dequantize(dtype)
        elif w.dim() == 1 or name.startswith("exit_gate."):
            dense = w.to(device=device, dtype=torch.float32)
        else:
            dense = w.to(device=device, dtype=dtype)
        if device.type == "cpu" and name != "embed.weight" and dense.dim() == 2 and dense.shape[0] >= dense.shape[1]:
            # Same [out, in] tensor, stored input-major: CPU BLAS streams it faster for one row (~1.3x), unless
            # it has more inputs than outputs (then the row-major layout is faster: ~1.6x for 1024 -> 384).
            dense = dense.t().contiguous().t()
        out[name] = dense
    return out


def _kernel_layout(w: Int4Weight) -> Int4Weight:
    """Plain INT4 matrices in the CUDA GEMV's blocked layout (quant.BlockedInt4Weight); the stochastic
    kinds keep their own layout for their own kernels."""
    return BlockedInt4Weight.from_int4(w) if type(w) is Int4Weight else w


def dequantize_int4_cpu(w: Int4Weight) -> torch.Tensor:
    """w.dequantize(float32), bit for bit, in the CPU layout of `_prepare` (input-major unless in > out)."""
    out_f, half = w.packed.shape
    if out_f < 2 * half:  # more inputs than outputs: row-major
        q = torch.stack((w.packed & 0x0F, w.packed >> 4), dim=-1).to(torch.float32)  # [out, in/2, 2] = [out, in]
        groups = q.view(out_f, -1, w.group_size)  # [out, in/G, G]
        groups.mul_(w.scale.to(torch.float32)[..., None]).add_(w.minimum.to(torch.float32)[..., None])
        return q.view(out_f, 2 * half)
    packed = w.packed.t().contiguous()  # [in/2, out]
    # [in/2, 2, out] = [in, out]: input 2k is byte k's low nibble, 2k + 1 its high nibble.
    q = torch.stack((packed & 0x0F, packed >> 4), dim=1).to(torch.float32)
    groups = q.view(-1, w.group_size, out_f)  # [in/G, G, out]
    groups.mul_(w.scale.t().to(torch.float32)[:, None, :]).add_(w.minimum.t().to(torch.float32)[:, None, :])
    return q.view(2 * half, out_f).t()


def load_engine(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype | None = None,
    cross_iter: CrossIterRound | None = None,
    max_positions: int | None = None,
) -> tuple[ModelHeader, Engine]:
    """max_positions: how many positions the run needs (position tables are sized by it; at most the model's
    max_position, which is the default)."""
    header = read_header(path)
    if max_positions is not None and not 1 <= max_positions <= header.config.max_position:
        raise ValueError(
            f"max_seq_len must be in [1, {header.config.max_position}] (the model's max_position), got {max_positions}"
        )
    _, flat = load_weights(path, device="cpu", header=header)
    compute = dtype or default_dtype(device, header.config)
    int4_matmuls = device.type == "cpu" and compute == torch.bfloat16
    if int4_matmuls:
        # bfloat16 elementwise ops and attention are slower than float32 ones on CPUs: only matmuls round.
        compute = torch.float32
        if cpu_int4.available():
            info("CPU: INT4 matmuls in bfloat16 (torch's INT4 kernel); activations, attention, KV cache in float32")
        else:
            info("CPU: this torch has no CPU INT4 kernel, so bfloat16 changes nothing: matmuls stay float32")
    # Stochastic matrices stay quantized: each loop iteration draws its own effective weight.
    kept = stochastic_weights(header.config, flat, cross_iter, device, path) if cross_iter is not None else {}
    cuda_env = RuntimeEnv.read() if device.type == "cuda" else None
    policy = cuda_backend.kernel_policy(cuda_env) if cuda_env is not None else None
    kernels = policy is not None and cuda_backend.install(policy)
    dense = prepare_weights(
        {n: w for n, w in flat.items() if n not in kept}, device, compute,
        keep_int4=kernels, dense_body=cuda_env is not None and cuda_env.fp16_body, int4_matmuls=int4_matmuls,
    )  # fmt: skip
    l2_plan = None
    if cuda_env is not None:
        off = "TINYLOOP_DISABLE_L2_RESIDENCY" if cuda_env.disable_l2_residency else None
        if not kernels:
            off = "no Triton kernels, so no decode graphs to carry the window"
        dense, l2_plan = keep_looped_resident(dense, device, cuda_backend.l2_cache_bytes(), off)
        report_cuda_memory(dense, cuda_env, l2_plan)
    prepared = {**dense, **kept}
    weights = ModelWeights.from_flat(header.config, prepared)
    l2_window = None if l2_plan is None else l2_plan.window
    engine = Engine(
        header.config, weights, device, compute, l2_window=l2_window, max_positions=max_positions, kernel_policy=policy
    )
    if log_level() >= 2:
        report_load(header.path, flat, prepared, engine)
    return header, engine


def report_cuda_memory(weights: Mapping[str, Weight], env: RuntimeEnv, l2_plan: L2Plan) -> None:
    """Level-1 lines: weight VRAM (and the 16-bit body's extra cost) and the L2 residency decision."""

    def nbytes(w: Weight) -> int:
        return w.nbytes if isinstance(w, (Int4Weight, Int8Weight)) else w.numel() * w.element_size()

    total = sum(nbytes(w) for w in weights.values())
    body = sum(nbytes(w) for n, w in weights.items() if n.startswith("body."))
    note = " (body dequantized to 16 bits: TINYLOOP_EXPERIMENTAL_FP16_BODY)" if env.fp16_body else ""
    info(f"weights on GPU: {total / 2**20:.1f} MiB, looped body {body / 2**20:.1f} MiB{note}")
    info(l2_plan.line)
