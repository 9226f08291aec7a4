"""Effective INT4 codes and weights of one matrix at one (seed, iteration, call) key: the torch reference."""

from __future__ import annotations

import numpy as np
import torch

from tinyloop.stochastic.channels import Channel, decode_channel, unpack_nibbles
from tinyloop.stochastic.pcg import MASK32, RANDOM_BITS, pcg_hash, pcg_hash_np

# Elements are counted by their row-major index; the hash takes 32-bit counters.
MAX_ELEMENTS = 1 << 32


def element_random(shape: tuple[int, int], key: int, device: torch.device | str) -> torch.Tensor:
    """The top RANDOM_BITS bits of pcg_hash(index ^ key) for every row-major element index, int64 [out, in]."""
    out_f, in_f = shape
    _check_size(out_f, in_f)
    index = torch.arange(out_f * in_f, dtype=torch.int64, device=device).view(out_f, in_f)
    return pcg_hash(index ^ (key & MASK32)) >> (32 - RANDOM_BITS)


def effective_codes(packed: torch.Tensor, channel: torch.Tensor, kind: Channel, key: int) -> torch.Tensor:
    """q_eff = clamp(q + direction * [r < count], 0, 15) per weight, uint8 [out, in].

    The clamp keeps every effective weight inside its group's [min, max] range, where the float weight is.
    """
    if packed.device.type == "cpu":
        return torch.from_numpy(effective_codes_np(packed.numpy(), channel.numpy(), kind, key))
    return effective_codes_torch(packed, channel, kind, key)


def effective_codes_torch(packed: torch.Tensor, channel: torch.Tensor, kind: Channel, key: int) -> torch.Tensor:
    """effective_codes with torch int64 ops, on any device (the path of a GPU without triton)."""
    q = unpack_nibbles(packed)
    direction, count = decode_channel(channel, kind)
    move = element_random((q.shape[0], q.shape[1]), key, q.device) < count
    return (q + direction * move).clamp_(0, 15).to(torch.uint8)


def effective_codes_np(packed: np.ndarray, channel: np.ndarray, kind: Channel, key: int) -> np.ndarray:
    """effective_codes on CPU in numpy's wrapping uint32 and small integer types (int64 torch ops are
    several times slower there); the same codes as effective_codes_torch."""
    out_f, half = packed.shape
    _check_size(out_f, 2 * half)
    q = np.stack((packed & 0x0F, packed >> 4), axis=-1).reshape(out_f, 2 * half).astype(np.int8)
    words = np.arange(out_f * 2 * half, dtype=np.uint32) ^ np.uint32(key & MASK32)
    r = (pcg_hash_np(words) >> np.uint32(32 - RANDOM_BITS)).astype(np.int8).reshape(q.shape)
    if kind == "sign":
        up = np.unpackbits(channel, axis=-1, bitorder="little").view(bool)
        move = r < 8
    else:
        k = np.stack((channel & 0x0F, channel >> 4), axis=-1).reshape(q.shape).astype(np.int8)
        signed = 2 * k - 15
        up = signed > 0
        move = r < np.abs(signed)
    step = np.where(up, move, -move.view(np.int8)).astype(np.int8)
    return np.clip(q + step, 0, 15).astype(np.uint8)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """codes * scale + min per group, in float32 then `dtype`.

    A 4-bit code times an fp16 scale is exact in float32, so a fused multiply-add rounds the same way
    as a multiply then an add: every backend gets the same bits.
    """
    out_f, in_f = codes.shape
    grouped = codes.to(torch.float32).view(out_f, in_f // group_size, group_size)
    w = grouped * scale.to(torch.float32)[..., None] + minimum.to(torch.float32)[..., None]
    return w.view(out_f, in_f).to(dtype)


def _check_size(out_f: int, in_f: int) -> None:
    if out_f * in_f > MAX_ELEMENTS:
        raise ValueError(f"a {out_f} x {in_f} matrix has more than 2^32 elements; the element counter would wrap")
