"""Launcher of the persistent MLP kernel (kernels/triton_persistent_mlp.py): which steps it takes, its tiles,
its scratch, and how many programs run.

How many programs: one per SM by default (`PersistentMlpTile.programs_per_sm` more, capped at what the compiled
kernel's registers, shared memory and warps let one SM hold). Items wait (spin) on items with smaller tickets, and
a ticket is only taken by a program that is running, so every wait is on an item some resident program is working
on: progress does not depend on how many programs fit. The cap keeps every program resident anyway (a launch
whose one program does not fit an SM fails instead of hanging). Under Triton's interpreter (the CPU tests) two
programs run one after the other: the first takes every item (and never waits), the second finds none and resets
the counters.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton

from tinyloop.kernels.policy import KernelPolicy, PersistentMlpTile
from tinyloop.kernels.triton_persistent_mlp import READY, _persistent_mlp_kernel
from tinyloop.log import info
from tinyloop.quant import BlockedInt4Weight

INTERPRETER_PROGRAMS = 2
NIBBLE_MASK = 0x00780000  # a nibble's place under float32's exponent of 1.0 (triton_matmul._blocked_f)

# (device, rows, d_model, ffn, dtype, tile) -> (h, acc, sync, xn): every launch leaves acc and sync zero, so
# one set serves every layer of a step and every replay of a captured graph (launches on one stream run in order).
_SCRATCH: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


# (device index, compile-time arguments) -> how many programs of that compiled kernel one SM holds
_RESIDENT: dict[tuple[object, ...], int] = {}


def _resident_per_sm(args: tuple, options: dict[str, Any], device_index: int) -> int:
    """Programs of the compiled kernel that fit one SM at once (registers, shared memory, threads); 1 where the
    compiled kernel cannot be inspected (then one per SM, which any launchable kernel fits)."""
    key = (device_index, args[0].dtype, *sorted(options.items()))
    if key not in _RESIDENT:
        try:
            compiled = _persistent_mlp_kernel.warmup(*args, grid=(1,), **options)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(device_index)
            threads = 32 * options["num_warps"]
            regs = -(-max(int(compiled.n_regs), 1) // 8) * 8 * threads  # allocated 8 per thread at a time
            register_file = getattr(props, "regs_per_multiprocessor", 65536)  # 64K 32-bit registers on Volta to Hopper
            fits = [register_file // regs, props.max_threads_per_multi_processor // threads]
            shared = int(compiled.metadata.shared)
            if shared:
                fits.append(props.shared_memory_per_multiprocessor // shared)
            _RESIDENT[key] = max(1, min(fits))
        except Exception as exc:  # an inspection this Triton or torch does not offer: the safe count
            info(f"persistent MLP kernel: occupancy unknown ({type(exc).__name__}: {exc}); one program per SM")
            _RESIDENT[key] = 1
    return _RESIDENT[key]


def persistent_mlp_applies(policy: KernelPolicy, x: torch.Tensor, gate_up: object, down: object) -> bool:
    """Whether the policy takes this MLP sublayer to the persistent kernel: on, a decode-sized step (1 to
    `matvec_max_rows` rows), SwiGLU weights in the blocked INT4 layout with one group size, and an ffn width the
    K slices divide."""
    if not (
        policy.persistent_decode and isinstance(gate_up, BlockedInt4Weight) and isinstance(down, BlockedInt4Weight)
    ):
        return False
    M, D = x.shape
    F = down.shape[1]
    return (
        1 <= M <= policy.matvec_max_rows
        and gate_up.shape == (2 * F, D)
        and down.shape == (D, F)
        and gate_up.group_size == down.group_size
        and D % gate_up.group_size == 0
        and policy.persistent_mlp_tile(D, F, M, down.group_size) is not None
    )


def _scratch(
    x: torch.Tensor, F: int, tile: PersistentMlpTile
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h, acc, sync, and xn (the prologue's x * g and 1 / rms(x); one element without it)."""
    M, D = x.shape
    key = (x.device, M, D, F, x.dtype, tile)
    if key not in _SCRATCH:
        counters = READY + F // tile.slice + triton.cdiv(D, tile.down_rows) + 1
        xn = M * (D + 1) if tile.x_prologue else 1
        _SCRATCH[key] = (
            torch.empty((M, F), dtype=torch.float32 if tile.h_float32 else x.dtype, device=x.device),
            torch.zeros((M, D), dtype=torch.float32, device=x.device),
            torch.zeros(counters, dtype=torch.int32, device=x.device),
            torch.empty(xn, dtype=torch.float32, device=x.device),
        )
    return _SCRATCH[key]


def _prefetches(tile: PersistentMlpTile, x: torch.Tensor, gate_up: BlockedInt4Weight, down: BlockedInt4Weight) -> bool:
    """Whether the kernel asks L2 for weights ahead (inline PTX, so never in the interpreter): the tile says so, the
    GPU has Hopper's bulk prefetch, and every range it asks for is 16-byte aligned and sized (rows of D / 2 and
    F / 2 bytes, D / GROUP scales per row in 8s, slices of 32 features)."""
    if not (tile.prefetch_next and x.is_cuda):
        return False
    D, F = x.shape[1], down.shape[1]
    bases = (gate_up.packed, gate_up.scale, gate_up.minimum, down.packed)
    return (
        torch.cuda.get_device_capability(x.device) >= (9, 0)
        and D % 32 == 0
        and F % 32 == 0
        and tile.slice % 32 == 0
        and (D // down.group_size) % 8 == 0
        and all(t.data_ptr() % 16 == 0 for t in bases)
    )


def persistent_mlp(
    policy: KernelPolicy,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: object,
    down: object,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(SwiGLU(rmsnorm(x) @ gate_up.T)) (+ residual) for x [M, D] in one launch, where
    `persistent_mlp_applies`. With a residual the result overwrites it (the caller's own tensor)."""
    assert isinstance(gate_up, BlockedInt4Weight) and isinstance(down, BlockedInt4Weight)
    M, D = x.shape
    F = down.shape[1]
    tile = policy.persistent_mlp_tile(D, F, M, down.group_size)
    assert tile is not None, "persistent_mlp_applies says which shapes the kernel takes"
    x = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.is_contiguous() and residual.dtype == x.dtype:
        out = residual
    else:
        out = torch.empty((M, D), dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    h, acc, sync, xn = _scratch(x, F, tile)
    n_items = (
        int(tile.x_prologue) + triton.cdiv(F, tile.gate_up_rows) + (F // tile.slice) * triton.cdiv(D, tile.down_rows)
    )
    args = (x, norm_weight, gate_up.packed.view(torch.int32), gate_up.scale, gate_up.minimum,
            down.packed.view(torch.int32), down.scale, down.minimum, h, acc, out, res, sync, xn,
            M, F, D, eps, x.stride(0), h.stride(0), out.stride(0), res.stride(0), D // 8, D // down.group_size,
            F // 8, F // down.group_size)  # fmt: skip
    options: dict[str, Any] = dict(
        GROUP=down.group_size, BLOCK=down.block, RESIDUAL=residual is not None, ROWS=triton.next_power_of_2(M),
        GU_N=tile.gate_up_rows, GU_B=tile.gate_up_blocks, SLICE=tile.slice, DN_N=tile.down_rows,
        TICKETS=tile.tickets, STATIC=tile.static, XPRO=int(tile.x_prologue), MASK_ARG=tile.mask_in_register,
        H32=tile.h_float32, PREFETCH=_prefetches(tile, x, gate_up, down), THREADS=32 * tile.warps,
        num_warps=tile.warps, **policy.pdl_options(),
    )  # fmt: skip
    if x.is_cuda:
        index = x.device.index or 0
        per_sm = tile.programs_per_sm
        if per_sm > 1:
            per_sm = min(per_sm, _resident_per_sm((*args, n_items, NIBBLE_MASK), options, index))
        programs = min(triton.cdiv(n_items, tile.tickets), per_sm * _sm_count(index))
    else:  # statically dealt items need every program running at once: one program takes them all
        programs = 1 if tile.static else min(triton.cdiv(n_items, tile.tickets), INTERPRETER_PROGRAMS)
    _persistent_mlp_kernel[(programs,)](*args, programs, NIBBLE_MASK, **options)
    return out
