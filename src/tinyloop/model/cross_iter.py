"""Cross-iteration rounding in the model: puts stochastic looped matrices into a loaded model and binds them
to each loop iteration."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from tinyloop import log
from tinyloop.config import ArchConfig
from tinyloop.kernels.cuda_backend import triton_available
from tinyloop.kernels.dispatch import Weight, register_linear_kernel
from tinyloop.layout import model_specs
from tinyloop.model.weights import LayerWeights, ModelWeights
from tinyloop.stochastic.cache import EffectiveCache, MiB
from tinyloop.stochastic.weight import (
    ChanneledInt4Weight,
    CrossIterRound,
    EffectiveWeightFn,
    StochasticInt4Weight,
    reference_effective_weight,
)

_MATRICES = ("qkv", "out", "gate_up", "up", "down")


def stochastic_weights(
    cfg: ArchConfig, flat: Mapping[str, Weight], rounding: CrossIterRound, device: torch.device, path: object = ""
) -> dict[str, StochasticInt4Weight]:
    """The file's channeled matrices as StochasticInt4Weight on the device, kept quantized (empty when the
    file has no channels; an error then if `rounding.require_channels`)."""
    calls = {s.name: i for i, s in enumerate(model_specs(cfg))}
    cache = EffectiveCache(rounding.cpu_cache_mib * MiB) if device.type == "cpu" and rounding.cpu_cache_mib else None
    draw = _draw_function(device)
    out: dict[str, StochasticInt4Weight] = {}
    for name, w in flat.items():
        if isinstance(w, ChanneledInt4Weight):
            moved = w.to(device)
            fields = {f.name: getattr(moved, f.name) for f in dataclasses.fields(ChanneledInt4Weight)}
            out[name] = StochasticInt4Weight(**fields, seed=rounding.seed, call=calls[name], cache=cache, draw=draw)
    if not out and rounding.require_channels:
        raise ValueError(
            f"{path}: cross_iter_round needs rounding channels, and this file has none; add them with "
            "tinyloop-add-sign-bit --from-pt CHECKPOINT --loop-only -i IN -o OUT"
        )
    if out and device.type == "cuda":
        _install_cuda_kernel()
    if out:
        kinds = sorted({w.channel_kind for w in out.values()})
        log.info(f"cross-iteration rounding: {len(out)} looped matrices ({', '.join(kinds)}), seed {rounding.seed}")
    else:
        log.info("cross-iteration rounding asked, but the file has no rounding channels: plain INT4")
    return out


def _draw_function(device: torch.device) -> EffectiveWeightFn:
    """The Triton kernel on CUDA when triton imports (an optional dependency), else the torch reference."""
    if device.type == "cuda" and triton_available():
        from tinyloop.kernels.triton_stochastic import draw_effective_weight

        return draw_effective_weight
    return reference_effective_weight


def _install_cuda_kernel() -> None:
    """Decode-sized products draw the weights inside a fused Triton matvec; without triton the dispatch
    fallback (dequantize(), then a dense matmul) runs the torch reference on the GPU."""
    if triton_available():
        from tinyloop.kernels.triton_stochastic import stochastic_linear

        register_linear_kernel("int4_stoch", "cuda", stochastic_linear)


def has_cross_iter(w: ModelWeights) -> bool:
    """Whether any looped matrix is stochastic (specialised decode paths must then stay off)."""
    if isinstance(w.adapter, StochasticInt4Weight):
        return True
    return any(isinstance(getattr(lw, m), StochasticInt4Weight) for lw in w.body for m in _MATRICES)


def at_iteration(w: ModelWeights, loop: int) -> ModelWeights:
    """`w` with its stochastic looped matrices bound to iteration `loop`; `w` itself when it has none."""
    if not has_cross_iter(w):
        return w
    body = tuple(_bind_layer(lw, loop) for lw in w.body)
    adapter = w.adapter.at(loop) if isinstance(w.adapter, StochasticInt4Weight) else w.adapter
    return dataclasses.replace(w, body=body, adapter=adapter)


def _bind_layer(lw: LayerWeights, loop: int) -> LayerWeights:
    bound = {m: getattr(lw, m).at(loop) for m in _MATRICES if isinstance(getattr(lw, m), StochasticInt4Weight)}
    return dataclasses.replace(lw, **bound) if bound else lw
