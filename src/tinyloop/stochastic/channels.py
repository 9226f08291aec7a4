"""Rounding channels: what each looped INT4 weight stores about its own rounding error, packed.

`sign`: 1 bit per weight, set when the float weight lies above its stored INT4 value.
`frac4`: 4 bits per weight, k = floor(16 * (e + 1/2)) clamped to 0..15, where e = u - q is the rounding
residual in quantization steps (u = (w - min) / scale, q the stored code, so e is in [-1/2, 1/2]).
"""

from __future__ import annotations

import torch

from tinyloop.quant import Int4Weight
from tinyloop.stochastic.channel_kinds import CHANNELS, Channel

__all__ = ["CHANNELS", "Channel", "FRAC_BITS", "channel_shape", "decode_channel", "encode_channel"]
FRAC_BITS: dict[int, Channel] = {1: "sign", 4: "frac4"}
_BIT_WEIGHTS = torch.tensor([1 << t for t in range(8)], dtype=torch.int64)


def channel_shape(kind: Channel, out_f: int, in_f: int) -> tuple[int, int]:
    """The stored U8 shape of a channel: 8 weights a byte (sign) or 2 (frac4)."""
    return (out_f, in_f // 8) if kind == "sign" else (out_f, in_f // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] uint8 -> [out, in] int64; column 2j is the low nibble of byte j."""
    p = packed.to(torch.int64)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/8] uint8 -> [out, in] int64; column 8j + t is bit t (least significant first) of byte j."""
    shifts = torch.arange(8, device=packed.device)
    return ((packed.to(torch.int64)[..., None] >> shifts) & 1).flatten(-2)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    out_f, in_f = bits.shape
    b = bits.to(torch.int64).reshape(out_f, in_f // 8, 8)
    return (b * _BIT_WEIGHTS.to(b.device)).sum(-1).to(torch.uint8).contiguous()


def rounding_residual(w_float: torch.Tensor, w4: Int4Weight) -> torch.Tensor:
    """e = (w - min) / scale - q per weight, float64, in quantization steps (0 where a group's scale is 0)."""
    out_f, in_f = w4.shape
    groups = in_f // w4.group_size
    u = w_float.detach().to("cpu", torch.float64).reshape(out_f, groups, w4.group_size)
    scale = w4.scale.to("cpu", torch.float64)[..., None]
    minimum = w4.minimum.to("cpu", torch.float64)[..., None]
    q = unpack_nibbles(w4.packed.to("cpu")).to(torch.float64).reshape(out_f, groups, w4.group_size)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    e = torch.where(scale > 0, (u - minimum) / safe - q, torch.zeros_like(u))
    return e.reshape(out_f, in_f)


def encode_channel(residual: torch.Tensor, kind: Channel) -> torch.Tensor:
    """The packed channel for residuals e (see the module docstring)."""
    if kind == "sign":
        return pack_bits(residual > 0)
    k = torch.floor(16.0 * (residual + 0.5)).clamp_(0, 15)
    return pack_nibbles(k)


def decode_channel(channel: torch.Tensor, kind: Channel) -> tuple[torch.Tensor, torch.Tensor]:
    """(direction, count) per weight, int64 [out, in]: with probability count/32 the code moves one
    step in `direction` (+1 or -1); see rounding.effective_codes."""
    if kind == "sign":
        bits = unpack_bits(channel)
        return 2 * bits - 1, torch.full_like(bits, 8)
    k = unpack_nibbles(channel)
    # The residual is read back as the middle of its 1/16 bucket: (2k - 15) / 32 steps.
    signed = 2 * k - 15
    return torch.where(signed > 0, 1, -1), signed.abs()
