"""Weight quantization math: INT8 per-row symmetric and INT4 group-wise asymmetric (torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Int8Weight:
    """w[o, i] ≈ q[o, i] * scale[o]; q int8 in [-127, 127], scale float16."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale.to(torch.float32)[:, None]).to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.q[index].to(torch.float32) * self.scale[index].to(torch.float32)[..., None]).to(dtype)

    def to(self, device: torch.device | str) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device))


@dataclass(frozen=True)
class Int4Weight:
    """w[o, g*G + j] ≈ q * scale[o, g] + minimum[o, g], q in 0..15.

    `packed[o, i // 2]` holds column i in its low nibble when i is even, high nibble when odd.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.packed.shape[0]), int(self.packed.shape[1]) * 2)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.minimum.nbytes

    def _expand(
        self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        low = (packed & 0x0F).to(torch.float32)
        high = (packed >> 4).to(torch.float32)
        q = torch.stack((low, high), dim=-1).flatten(-2)  # [..., in]
        grouped = q.unflatten(-1, (-1, self.group_size))  # [..., in/G, G]
        w = grouped * scale.to(torch.float32)[..., None] + minimum.to(torch.float32)[..., None]
        return w.flatten(-2).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._expand(self.packed, self.scale, self.minimum, dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._expand(self.packed[index], self.scale[index], self.minimum[index], dtype)

    def to(self, device: torch.device | str) -> Int4Weight:
        return Int4Weight(self.packed.to(device), self.scale.to(device), self.minimum.to(device), self.group_size)


QuantizedWeight = Int8Weight | Int4Weight


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    w32 = w.detach().to(torch.float32)
    amax = w32.abs().amax(dim=1).clamp_min(1e-12)
    scale = (amax / 127.0).to(torch.float16)
    # Round with the stored (16-bit) scale so that dequantization uses exactly what was divided by.
    s = scale.to(torch.float32).clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round(w32 / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Weight:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"INT4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"INT4 needs in_features ({in_f}) divisible by the group size ({group_size})")
    g = w.detach().to(torch.float32).reshape(out_f, in_f // group_size, group_size)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    minimum = lo.to(torch.float16)
    scale = ((hi - lo) / 15.0).to(torch.float16)
    s = scale.to(torch.float32)
    m = minimum.to(torch.float32)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((g - m[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(out_f, in_f)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return Int4Weight(packed, scale.contiguous(), minimum.contiguous(), group_size)
