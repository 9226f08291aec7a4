"""Chooses the specialised decode step for an engine's device (CPU fast path, CUDA graphs) if one applies.

`Engine.step` offers every call over a dense `KVCache` in the compute dtype (or over no cache) that does not
ask for hidden states to its decoder first; the decoder handles what it covers and declines the rest by
returning None, which runs the generic `forward`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from tinyloop.cache.kv import KVCache
from tinyloop.model.looped import ForwardOutput

if TYPE_CHECKING:
    from tinyloop.runtime.engine import Engine


class Decoder(Protocol):
    def decode(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None,
        loops: int,
        valid: torch.Tensor | None,
        last_only: bool,
        start: torch.Tensor,
        resume: tuple[torch.Tensor, torch.Tensor] | None,
        start_loop: int,
    ) -> ForwardOutput | None:
        """`Engine.step`'s arguments, `start` ([B], CPU) already resolved; None = not handled.

        Must leave `cache.lengths` untouched: the engine updates it.
        """
        ...

    def release(self) -> None:
        """Drops what the decoder keeps between steps (captured graphs, scratch caches); later steps rebuild it."""
        ...


def select_decoder(engine: Engine) -> Decoder | None:
    """The decoder for this engine, or None for the generic forward everywhere."""
    if engine.device.type == "cpu":
        from tinyloop.runtime import cpu_decode

        if not cpu_decode.supports(engine.cfg, engine.weights, engine.device, engine.dtype):
            return None
        return cpu_decode.CpuDecoder(engine.cfg, engine.weights, engine.cos, engine.sin, engine.noise)
    from tinyloop.model.cross_iter import has_cross_iter

    if has_cross_iter(engine.weights):  # each iteration draws its own weights: only the generic path does
        return None
    if engine.device.type == "cuda":
        from tinyloop.kernels.cuda_backend import triton_available

        if not triton_available():
            return None
        from tinyloop.runtime.fused_decode import FusedDecoder

        return FusedDecoder(engine)
    return None
