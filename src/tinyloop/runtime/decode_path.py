"""What a specialised decode step (CPU fast path, CUDA graphs) is to the engine, and what it reads from it.

`Engine.step` offers every call over a dense `KVCache` in the compute dtype (or over no cache) that does not
ask for hidden states to its decoder first; the decoder handles what it covers and declines the rest by
returning None, which runs the generic `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tinyloop.cache.kv import KVCache
from tinyloop.config import ArchConfig
from tinyloop.kernels.policy import KernelPolicy
from tinyloop.model.looped import ForwardOutput, Resume
from tinyloop.model.weights import ModelWeights

if TYPE_CHECKING:
    from tinyloop.kernels.l2_residency import L2Window


@dataclass(frozen=True)
class StepInput:
    """What `Engine.step` asks of a decoder (see there), with `start` resolved: tokens [B, T] at positions
    start[b].. ([B], CPU); valid[b] real tokens in row b (None: all T); with `resume` only the iterations after
    resume.start_loop, the coda and the head run."""

    tokens: torch.Tensor
    loops: int
    start: torch.Tensor
    valid: torch.Tensor | None = None
    last_only: bool = False
    resume: Resume | None = None

    def ragged(self) -> bool:
        """Whether some row has fewer real tokens than the step's T (right-padded prompts)."""
        return self.valid is not None and bool((self.valid.to("cpu") != self.tokens.shape[1]).any())


class Decoder(Protocol):
    def decode(self, step: StepInput, cache: KVCache | None) -> ForwardOutput | None:
        """The step over `cache` (None: an uncached forward from position 0), or None = not handled.

        Must leave `cache.lengths` untouched: the engine updates it.
        """
        ...

    def release(self) -> None:
        """Drops what the decoder keeps between steps (captured graphs, scratch caches); later steps rebuild it."""
        ...


class DecoderHost(Protocol):
    """What a decoder reads from its engine (runtime/engine.py), which owns it."""

    cfg: ArchConfig
    weights: ModelWeights
    device: torch.device
    dtype: torch.dtype
    cos: torch.Tensor
    sin: torch.Tensor
    noise: torch.Tensor | None
    l2_window: L2Window | None
    kernel_policy: KernelPolicy

    def new_cache(self, batch: int, max_seq: int, loops: int) -> KVCache: ...
