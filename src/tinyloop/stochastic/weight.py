"""INT4 weights that carry a rounding channel, and their stochastic form bound to a loop iteration."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinyloop.quant import Int4Weight
from tinyloop.stochastic.cache import EffectiveCache
from tinyloop.stochastic.channels import CHANNELS, Channel, channel_shape
from tinyloop.stochastic.pcg import MASK32, call_key
from tinyloop.stochastic.rounding import dequantize_codes, effective_codes


@dataclass(frozen=True)
class CrossIterRound:
    """Cross-iteration stochastic rounding switched on, with the seed every rounding decision derives from.

    require_channels: refuse a file without rounding channels (an explicit request) instead of running
    it as plain INT4 (the environment switch).
    cpu_cache_mib: on CPU, keep drawn effective weights up to this size, so that decode steps reuse
    them (a draw costs far more than the matmul there); 0 draws every time. GPUs always redraw.
    """

    seed: int = 0
    require_channels: bool = False
    cpu_cache_mib: int = 512

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MASK32:
            raise ValueError(f"cross_iter_seed must be an integer in [0, 2**32), got {self.seed!r}")
        if isinstance(self.cpu_cache_mib, bool) or not isinstance(self.cpu_cache_mib, int) or self.cpu_cache_mib < 0:
            raise ValueError(f"cpu_cache_mib must be an integer >= 0, got {self.cpu_cache_mib!r}")


@dataclass(frozen=True)
class ChanneledInt4Weight(Int4Weight):
    """An Int4Weight plus its rounding channel; everything that does not know channels sees plain INT4."""

    channel: torch.Tensor
    channel_kind: Channel

    def __post_init__(self) -> None:
        if self.channel_kind not in CHANNELS:
            raise ValueError(f"channel kind must be one of {list(CHANNELS)}, got {self.channel_kind!r}")
        want = channel_shape(self.channel_kind, *self.shape)
        if tuple(self.channel.shape) != want or self.channel.dtype != torch.uint8:
            found = f"{self.channel.dtype} {list(self.channel.shape)}"
            raise ValueError(f"a {self.channel_kind} channel must be uint8 {list(want)}, found {found}")

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.channel.nbytes

    def to(self, device: torch.device | str) -> ChanneledInt4Weight:
        return dataclasses.replace(
            self,
            packed=self.packed.to(device),
            scale=self.scale.to(device),
            minimum=self.minimum.to(device),
            channel=self.channel.to(device),
        )


EffectiveWeightFn = Callable[[ChanneledInt4Weight, int, torch.dtype], torch.Tensor]


def reference_effective_weight(w: ChanneledInt4Weight, key: int, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight in `dtype` for one key, in torch (the reference every backend matches bit for bit)."""
    codes = effective_codes(w.packed, w.channel, w.channel_kind, key)
    return dequantize_codes(codes, w.scale, w.minimum, w.group_size, dtype)


@dataclass(frozen=True)
class StochasticInt4Weight(ChanneledInt4Weight):
    """A looped matrix whose dequantized value is drawn afresh for each loop iteration.

    call: the matrix's index in the layout, so two matrices never share a random stream.
    iteration: the loop iteration it is bound to; None (outside the loop) dequantizes as plain INT4.
    cache: shared by a model's stochastic matrices (CPU), or None.
    draw: computes the effective weight for a key; chosen at load (the Triton kernel on CUDA), same bits.
    """

    seed: int = 0
    call: int = 0
    iteration: int | None = None
    cache: EffectiveCache | None = field(default=None, compare=False, repr=False)
    draw: EffectiveWeightFn = field(default=reference_effective_weight, compare=False, repr=False)

    @property
    def key(self) -> int | None:
        return None if self.iteration is None else call_key(self.seed, self.iteration, self.call)

    def at(self, iteration: int) -> StochasticInt4Weight:
        return dataclasses.replace(self, iteration=iteration)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        key = self.key
        if key is None or self.iteration is None:
            return super().dequantize(dtype)
        cached = self.cache.get(self.call, self.iteration, dtype) if self.cache is not None else None
        if cached is not None:
            return cached
        w = self.draw(self, key, dtype)
        if self.cache is not None:
            self.cache.put(self.call, self.iteration, dtype, w)
        return w
