"""Weight quantization math: INT8 per-row symmetric and INT4 group-wise asymmetric (torch)."""

from __future__ import annotations

from collections.abc import Callable
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

    def codes(self, packed: torch.Tensor) -> torch.Tensor:
        """The 4-bit codes of `packed` (rows of self.packed) as uint8 [..., in], in column order."""
        return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)

    def _expand(
        self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        q = self.codes(packed).to(torch.float32)  # [..., in]
        grouped = q.unflatten(-1, (-1, self.group_size))  # [..., in/G, G]
        w = grouped * scale.to(torch.float32)[..., None] + minimum.to(torch.float32)[..., None]
        return w.flatten(-2).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._expand(self.packed, self.scale, self.minimum, dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._expand(self.packed[index], self.scale[index], self.minimum[index], dtype)

    def to(self, device: torch.device | str) -> Int4Weight:
        return Int4Weight(self.packed.to(device), self.scale.to(device), self.minimum.to(device), self.group_size)


@dataclass(frozen=True)
class BlockedInt4Weight(Int4Weight):
    """An Int4Weight whose bytes are in the CUDA GEMV's order (kernels/triton_matmul.py): as int32 words,
    word i of each `block`-column block b (block = min(group, 64): one group) holds column
    block * b + (block / 8) * j + i in nibble j (low nibble first), so a thread's consecutive words need
    consecutive x values for each nibble. Scale and minimum are unchanged; dequantize() and rows() return
    the natural column order."""

    @staticmethod
    def block_for(group_size: int) -> int:
        return min(group_size, 64)

    @property
    def block(self) -> int:
        return self.block_for(self.group_size)

    @classmethod
    def from_int4(cls, w: Int4Weight) -> BlockedInt4Weight:
        if type(w) is not Int4Weight:
            raise ValueError(f"the blocked INT4 layout repacks a plain Int4Weight, got {type(w).__name__}")
        n, half = w.packed.shape
        block = cls.block_for(w.group_size)
        q = w.codes(w.packed).view(n, 2 * half // block, 8, block // 8).to(torch.int32)  # [n, block, j, i]
        words = torch.zeros((n, 2 * half // block, block // 8), dtype=torch.int32, device=w.packed.device)
        for j in range(8):
            words |= q[:, :, j, :] << (4 * j)  # nibble 7 lands in the sign bit: int32 wraps as intended
        packed = words.view(n, half // 4).view(torch.uint8).view(n, half)
        return cls(packed.contiguous(), w.scale, w.minimum, w.group_size)

    def codes(self, packed: torch.Tensor) -> torch.Tensor:
        lead, half = packed.shape[:-1], packed.shape[-1]
        words = packed.contiguous().view(torch.int32).view(*lead, 2 * half // self.block, self.block // 8)
        nibbles = torch.stack([(words >> (4 * j)) & 0x0F for j in range(8)], dim=-2)  # [..., block, j, i]
        return nibbles.to(torch.uint8).reshape(*lead, 2 * half)

    def to(self, device: torch.device | str) -> BlockedInt4Weight:
        moved = (self.packed.to(device), self.scale.to(device), self.minimum.to(device))
        return BlockedInt4Weight(*moved, self.group_size)


def tinygemm_scales_zeros(w: Int4Weight) -> torch.Tensor:
    """w's scales and minimums as torch's tinygemm INT4 kernels (CPU and CUDA) take them: [in / G, out, 2]
    bfloat16 scale and zero, for (q - 8) * scale + zero, so zero = minimum + 8 * scale."""
    scale, minimum = w.scale.to(torch.float32), w.minimum.to(torch.float32)
    return torch.stack((scale.t(), (minimum + 8 * scale).t()), dim=-1).to(torch.bfloat16).contiguous()


@dataclass(frozen=True)
class CudaTinygemmWeight:
    """An INT4 matrix in the layout of torch's CUDA tinygemm kernel (`aten._weight_int4pack_mm`: bfloat16 rows
    times INT4 on tensor cores, weights dequantized as (q - 8) * scale + zero in bfloat16). Made from an
    Int4Weight on a CUDA device (`from_int4`, where `supports` says its shape fits the kernel)."""

    packed: torch.Tensor  # aten._convert_weight_to_int4pack's layout, opaque
    scales_zeros: torch.Tensor  # [in / G, out, 2] bfloat16 (tinygemm_scales_zeros)
    group_size: int
    out_features: int
    in_features: int

    # K tiles per warp of the packed layout: 2, 4 and 8 timed within 4.5 % of each other on an H100, 8 the fastest
    # at 25 of seed-407m's 32 products x row counts (1-64) and never 3 % behind (bench/tinygemm_inner_tiles.py).
    INNER_K_TILES = 8

    @classmethod
    def supports(cls, w: Int4Weight) -> bool:
        n, k = w.shape
        return n % 8 == 0 and k % (16 * cls.INNER_K_TILES) == 0 and w.group_size in (32, 64, 128, 256)

    @classmethod
    def from_int4(cls, w: Int4Weight, inner_k_tiles: int = INNER_K_TILES) -> CudaTinygemmWeight:
        if not cls.supports(w) or w.packed.device.type != "cuda":
            raise ValueError(
                f"the CUDA tinygemm layout takes a CUDA INT4 matrix with out % 8 == 0, in % "
                f"{16 * cls.INNER_K_TILES} == 0 and groups of 32-256 columns, got {tuple(w.shape)} with groups of "
                f"{w.group_size} on {w.packed.device.type}"
            )
        codes = w.codes(w.packed)  # [out, in] uint8, column order
        pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).contiguous()  # even column in the high nibble
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
        return cls(packed, tinygemm_scales_zeros(w), w.group_size, *w.shape)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] (bfloat16) @ w.T -> [M, out] bfloat16, accumulated in float32."""
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_zeros)


# Nibble of a CudaMmaInt4Weight word that holds column 8 w + e (e = 0..7): the order in which the decoding of
# kernels/gluon_int4_mma.py emits 16-bit weights (output register j holds nibbles j and j + 4, low half first).
MMA_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
# Tiles of x rows a CudaMmaInt4Weight's counters cover: 64 rows in tiles of 8.
MMA_MAX_X_TILES = 8


@dataclass(frozen=True)
class CudaMmaInt4Weight:
    """An INT4 matrix for the tensor-core product of kernels/gluon_int4_mma.py (batched decode steps): `words`
    [out, in / 8] int32 in column order (word w holds columns 8 w..8 w + 7, column 8 w + e in nibble
    MMA_NIBBLE_OF_COLUMN[e]) and `pairs` [out, in / G] int32, each group's scale (low 16 bits) and zero =
    minimum + 8 scale (high 16 bits) in `dtype`, so that the kernel decodes a weight as (q - 8) * scale + zero with
    one 16-bit rounding (the centred zero is small, so rounding it costs less than rounding the minimum).
    As many bytes as the INT4 matrix. Made from an Int4Weight (plain or blocked) on its device (`from_int4`).
    `arrivals`: the kernel's per-tile counters of finished K splits (zero between launches; the last program of
    a tile resets its counter), enough for tiles of 16 weight rows and 8 x rows at up to 64 rows; launches on
    one copy must not overlap (an engine runs its steps one at a time)."""

    words: torch.Tensor
    pairs: torch.Tensor
    group_size: int
    dtype: torch.dtype
    arrivals: torch.Tensor

    @classmethod
    def supports(cls, w: Int4Weight, dtype: torch.dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float16) and w.group_size % 8 == 0 and w.shape[1] % 8 == 0

    @classmethod
    def from_int4(cls, w: Int4Weight, dtype: torch.dtype) -> CudaMmaInt4Weight:
        if not cls.supports(w, dtype):
            raise ValueError(
                f"the tensor-core INT4 layout takes bfloat16 or float16 compute and groups of a multiple of 8 "
                f"columns, got {dtype} and groups of {w.group_size}"
            )
        codes = w.codes(w.packed).to(torch.int64)  # [out, in] in column order
        n, k = codes.shape
        by_word = codes.view(n, k // 8, 8)
        words = torch.zeros((n, k // 8), dtype=torch.int64, device=codes.device)
        for e, nibble in enumerate(MMA_NIBBLE_OF_COLUMN):
            words |= by_word[..., e] << (4 * nibble)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        scale = w.scale.to(torch.float32)
        low = scale.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
        high = (w.minimum.to(torch.float32) + 8 * scale).to(dtype).view(torch.int16).to(torch.int32) << 16
        arrivals = torch.zeros(n // 16 * MMA_MAX_X_TILES, dtype=torch.int32, device=codes.device)
        return cls(words.contiguous(), (low | high).contiguous(), w.group_size, dtype, arrivals)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.words.shape[0], self.words.shape[1] * 8)

    @property
    def nbytes(self) -> int:
        return self.words.nbytes + self.pairs.nbytes + self.arrivals.nbytes

    def codes(self) -> torch.Tensor:
        """The INT4 codes [out, in] in column order."""
        shifts = torch.tensor([4 * n for n in MMA_NIBBLE_OF_COLUMN], dtype=torch.int32, device=self.words.device)
        return ((self.words[..., None] >> shifts) & 0xF).flatten(-2)

    def dequantize(self) -> torch.Tensor:
        """What the kernel multiplies: (q - 8) * scale + zero from the 16-bit scale and zero, rounded to `dtype`."""
        scale = self.pairs.to(torch.int16).view(self.dtype).to(torch.float64)
        zero = (self.pairs >> 16).to(torch.int16).view(self.dtype).to(torch.float64)
        q = self.codes().to(torch.float64).unflatten(-1, (-1, self.group_size)) - 8
        return (q * scale[..., None] + zero[..., None]).flatten(-2).to(self.dtype)


@dataclass(frozen=True)
class CpuInt4Weight(Int4Weight):
    """An Int4Weight also held for bfloat16 compute on the CPU (kernels/cpu_int4.py): `tinygemm` in the layout
    of torch's CPU INT4 kernel, which computes with (q - 8) * scale + zero from bfloat16 `scales_zeros`
    (zero = minimum + 8 * scale), and `many_rows`, the bfloat16 matrix that calls of many rows multiply with
    (plain [out, in], or in the layout `many_rows_layout` gave it at packing, e.g. oneDNN's reordered one).
    `table`: the plain bfloat16 matrix, kept only for a table whose rows are looked up (the embedding)."""

    tinygemm: torch.Tensor  # [out, in / 2] uint8
    scales_zeros: torch.Tensor  # [in / G, out, 2] bfloat16
    many_rows: torch.Tensor  # Int4Weight.dequantize(bfloat16), plain or reordered
    table: torch.Tensor | None = None  # [out, in] bfloat16, = Int4Weight.dequantize(bfloat16)

    @classmethod
    def from_int4(
        cls,
        w: Int4Weight,
        many_rows_layout: Callable[[torch.Tensor], torch.Tensor] | None = None,
        table: bool = False,
    ) -> CpuInt4Weight:
        if type(w) is not Int4Weight or w.packed.device.type != "cpu":
            raise ValueError(f"the CPU INT4 layout repacks a plain Int4Weight on the CPU, got {type(w).__name__}")
        codes = w.codes(w.packed).to(torch.int32)  # [out, in]
        tinygemm = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_zeros = tinygemm_scales_zeros(w)
        dense = w.dequantize(torch.bfloat16).contiguous()
        many_rows = dense if many_rows_layout is None else many_rows_layout(dense)
        kept = dense if table or many_rows is dense else None
        return cls(w.packed, w.scale, w.minimum, w.group_size, tinygemm, scales_zeros, many_rows, kept)

    @property
    def dense(self) -> torch.Tensor:
        """The plain bfloat16 matrix [out, in] (= Int4Weight.dequantize(bfloat16)): kept, or made again."""
        if self.table is not None:
            return self.table
        return Int4Weight.dequantize(self, torch.bfloat16)

    @property
    def nbytes(self) -> int:
        extra = self.many_rows.nbytes + (0 if self.table is None or self.table is self.many_rows else self.table.nbytes)
        return super().nbytes + self.tinygemm.nbytes + self.scales_zeros.nbytes + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dense if dtype == torch.bfloat16 else super().dequantize(dtype)

    def to(self, device: torch.device | str) -> Int4Weight:
        if torch.device(device).type == "cpu":
            return self
        return Int4Weight(self.packed, self.scale, self.minimum, self.group_size).to(device)


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
