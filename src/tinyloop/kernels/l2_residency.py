"""Keeps the looped body resident in L2 on CUDA: its weights in one arena and an access-policy window over it
on the stream the decode graphs are captured from (CUDA driver API, through ctypes)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tinyloop.kernels.dispatch import Weight
from tinyloop.quant import BlockedInt4Weight, Int4Weight

# Tensors read once per loop: the body's and the concat adapter's.
LOOPED_PREFIXES = ("body.", "adapter.")
# Arena offsets are multiples of this (TMA needs 16 bytes; 256 keeps every tensor on its own cache lines).
ALIGN = 256
# A body larger than the persisting share of L2 gets a window over (at most) the whole body with a hit ratio of
# share / window, so that part of it persists, where this is set.
PARTIAL_WINDOW = False
# Give the persisting share (and its lines) up before each prefill-sized step and take it back before the next
# windowed decode graph (runtime/fused_decode.py), so that a prefill's GEMMs get all of L2. Off: not measured yet
# (the L2 A/B that would time it is in the git history of bench/gpu_suite.py). Releasing only the lines before each
# prefill did not help (H200: one-body seed-407m prefill 128 in 1.63 ms against 1.60 with the lines
# kept and 1.49 with L2 residency off), which points at the share itself.
SHARE_OFF_DURING_PREFILL = False

# CUDA driver API constants (cuda.h).
_CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
_CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
_CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_CU_ACCESS_PROPERTY_STREAMING = 1
_CU_ACCESS_PROPERTY_PERSISTING = 2


@dataclass(frozen=True)
class L2Window:
    """An access-policy window: `nbytes` from device address `base`, a `hit_ratio` share of it persisting."""

    base: int
    nbytes: int
    hit_ratio: float


@dataclass(frozen=True)
class L2Plan:
    """What `keep_looped_resident` decided: the window (None: not applied) and the level-1 line saying why."""

    window: L2Window | None
    persisting_bytes: int
    line: str


def plan_window(looped_bytes: int, max_persisting: int, max_window: int, partial: bool) -> tuple[int, float] | None:
    """(window bytes, hit ratio) for `looped_bytes` of weights, given the device's largest persisting L2 share
    and access-policy window; None where the weights do not fit and `partial` is off (or nothing to keep)."""
    if looped_bytes <= 0 or max_persisting <= 0 or max_window <= 0:
        return None
    if looped_bytes <= min(max_persisting, max_window):
        return looped_bytes, 1.0
    if not partial:
        return None
    window = min(looped_bytes, max_window)
    return window, min(1.0, max_persisting / window)


def _parts(w: Weight) -> list[torch.Tensor]:
    if type(w) in (Int4Weight, BlockedInt4Weight):
        assert isinstance(w, Int4Weight)
        return [w.packed, w.scale, w.minimum]
    return [w] if isinstance(w, torch.Tensor) else []  # other kinds (INT8, stochastic) keep their storage


def pack_contiguous(tensors: list[torch.Tensor], align: int = ALIGN) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One uint8 arena on the tensors' device holding copies of `tensors`, each at an `align`-byte offset, and
    the copies as views of it (same dtype, shape, values; contiguous)."""
    if not tensors:
        raise ValueError("pack_contiguous needs at least one tensor")
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // align) * align
    arena = torch.empty(end, dtype=torch.uint8, device=tensors[0].device)
    views = []
    for t, offset in zip(tensors, offsets, strict=True):
        view = arena[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
    return arena, views


def pack_looped(weights: Mapping[str, Weight]) -> tuple[dict[str, Weight], torch.Tensor | None]:
    """`weights` with every looped tensor (LOOPED_PREFIXES) moved into one arena, and the arena (None where
    there is nothing to move)."""
    names = [n for n, w in weights.items() if n.startswith(LOOPED_PREFIXES) and _parts(w)]
    if not names:
        return dict(weights), None
    arena, views = pack_contiguous([t for n in names for t in _parts(weights[n])])
    out = dict(weights)
    it = iter(views)
    for n in names:
        w = weights[n]
        if isinstance(w, Int4Weight):
            out[n] = type(w)(next(it), next(it), next(it), w.group_size)
        else:
            out[n] = next(it)
    return out, arena


class _AccessPolicyWindow(ctypes.Structure):
    _fields_ = [
        ("base_ptr", ctypes.c_void_p),
        ("num_bytes", ctypes.c_size_t),
        ("hit_ratio", ctypes.c_float),
        ("hit_prop", ctypes.c_int),
        ("miss_prop", ctypes.c_int),
    ]


class _StreamAttrValue(ctypes.Union):  # CUstreamAttrValue: a 64-byte union
    _fields_ = [("window", _AccessPolicyWindow), ("pad", ctypes.c_char * 64)]


class DriverError(RuntimeError):
    """A CUDA driver call for L2 residency failed (its name and CUresult in the message)."""


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise DriverError(f"the CUDA driver library libcuda.so.1 cannot be loaded ({exc})") from None
    status = lib.cuInit(0)  # idempotent; torch may not have touched the driver yet
    if status != 0:
        raise DriverError(f"cuInit returned CUresult {status}")
    return lib


def _call(name: str, *args: object) -> None:
    status = getattr(_driver(), name)(*args)
    if status != 0:
        raise DriverError(f"{name} returned CUresult {status}")


def device_limits(device: torch.device) -> tuple[int, int]:
    """(largest persisting L2 share, largest access-policy window) of `device`, in bytes."""
    dev, values = ctypes.c_int(), []
    _call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(device.index or 0))
    for attribute in (
        _CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
        _CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE,
    ):
        value = ctypes.c_int()
        _call("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(attribute), dev)
        values.append(value.value)
    return values[0], values[1]


def persisting_limit() -> int:
    """The current context's persisting L2 share, in bytes."""
    value = ctypes.c_size_t()
    _call("cuCtxGetLimit", ctypes.byref(value), ctypes.c_int(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE))
    return value.value


def set_persisting_limit(nbytes: int) -> int:
    """Asks the current context for an `nbytes` persisting L2 share (never shrinking one another model set);
    returns what the driver granted."""
    if nbytes > persisting_limit():
        _call("cuCtxSetLimit", ctypes.c_int(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE), ctypes.c_size_t(nbytes))
    return persisting_limit()


def release_persisting_lines() -> None:
    """Turns every persisting L2 line of the current context back to normal (a closed model's arena is gone;
    other models' graphs keep their windows and re-acquire their lines as they read them)."""
    _call("cuCtxResetPersistingL2Cache")


def drop_persisting_share() -> None:
    """No persisting L2 share for the current context, and its persisting lines back to normal (for every model
    of the context: their decode graphs' windows then read L2 as normal lines until a share is set again)."""
    release_persisting_lines()
    _call("cuCtxSetLimit", ctypes.c_int(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE), ctypes.c_size_t(0))


def set_stream_window(stream: torch.cuda.Stream, window: L2Window) -> None:
    """Kernels launched on (or captured from) `stream` read the window's lines as persisting, the rest streaming."""
    value = _StreamAttrValue()
    value.window = _AccessPolicyWindow(
        window.base, window.nbytes, window.hit_ratio, _CU_ACCESS_PROPERTY_PERSISTING, _CU_ACCESS_PROPERTY_STREAMING
    )
    _set_window_attribute(stream, value)


def clear_stream_window(stream: torch.cuda.Stream) -> None:
    """`stream` carries no access-policy window any more (a zero-byte one)."""
    _set_window_attribute(stream, _StreamAttrValue())


def _set_window_attribute(stream: torch.cuda.Stream, value: _StreamAttrValue) -> None:
    handle = ctypes.c_void_p(stream.cuda_stream)
    _call("cuStreamSetAttribute", handle, ctypes.c_int(_CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW), ctypes.byref(value))


@contextmanager
def window_during(stream: torch.cuda.Stream, window: L2Window | None) -> Iterator[str | None]:
    """`stream` carries `window` inside the block only, yielding None, or why it carries none (a driver
    error). torch hands its pooled streams out again, and a window left on one would outlive the memory it
    covers; graphs captured inside the block keep the window on their kernel nodes."""
    if window is None:
        yield None
        return
    try:
        set_stream_window(stream, window)
    except DriverError as exc:
        yield str(exc)
        return
    try:
        yield None
    finally:
        clear_stream_window(stream)


def stream_window(stream: torch.cuda.Stream) -> L2Window:
    """The access-policy window `stream` carries (zero bytes: none)."""
    value = _StreamAttrValue()
    handle = ctypes.c_void_p(stream.cuda_stream)
    _call("cuStreamGetAttribute", handle, ctypes.c_int(_CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW), ctypes.byref(value))
    w = value.window
    return L2Window(int(w.base_ptr or 0), int(w.num_bytes), float(w.hit_ratio))


def keep_looped_resident(
    weights: Mapping[str, Weight], device: torch.device, l2_bytes: int, off_reason: str | None = None
) -> tuple[dict[str, Weight], L2Plan]:
    """On CUDA, where the looped weights fit the persisting share of L2 (or PARTIAL_WINDOW): the weights with
    the looped ones packed into one arena, and the window over it that the decode graphs' capture stream gets.
    `off_reason` (say, the switch that turned it off) skips it. Driver failures leave the weights as they are
    and say so in the plan's line; they never raise."""
    looped = sum(
        t.numel() * t.element_size() for n, w in weights.items() if n.startswith(LOOPED_PREFIXES) for t in _parts(w)
    )
    head = f"L2 residency: looped body {looped / 2**20:.1f} MiB, L2 {l2_bytes / 2**20:.0f} MiB"
    if off_reason is not None:
        return dict(weights), L2Plan(None, 0, f"{head}: off ({off_reason})")
    if device.type != "cuda":
        return dict(weights), L2Plan(None, 0, f"{head}: not on CUDA")
    try:
        max_persisting, max_window = device_limits(device)
    except DriverError as exc:
        return dict(weights), L2Plan(None, 0, f"{head}: not applied ({exc})")
    limits = f"persisting share up to {max_persisting / 2**20:.0f} MiB, window up to {max_window / 2**20:.0f} MiB"
    # The arena's alignment padding is read by no kernel, but the window spans it.
    padded = sum(
        -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        for n, w in weights.items()
        if n.startswith(LOOPED_PREFIXES)
        for t in _parts(w)
    )
    plan = plan_window(padded, max_persisting, max_window, PARTIAL_WINDOW)
    if plan is None:
        return dict(weights), L2Plan(None, 0, f"{head}: does not fit ({limits}); not applied")
    nbytes, _ = plan
    try:
        granted = set_persisting_limit(min(max_persisting, nbytes))
    except DriverError as exc:
        return dict(weights), L2Plan(None, 0, f"{head}: not applied ({exc})")
    packed, arena = pack_looped(weights)
    assert arena is not None and arena.numel() == padded
    window = L2Window(arena.data_ptr(), nbytes, min(1.0, granted / nbytes))
    line = (
        f"{head}: kept resident ({window.nbytes / 2**20:.1f} MiB window, hit ratio {window.hit_ratio:.2f}, "
        f"{granted / 2**20:.1f} MiB persisting share; {limits})"
    )
    return packed, L2Plan(window, granted, line)
