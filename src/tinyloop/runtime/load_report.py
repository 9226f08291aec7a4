"""TINYLOOP_LOG_LEVEL=2 lines about a load: each component's tensors as stored and as prepared on the device,
and the decode path (what it will capture). The engine reports its position tables as it sizes them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch

from tinyloop.kernels.dispatch import Weight
from tinyloop.log import detail
from tinyloop.quant import Int4Weight, Int8Weight
from tinyloop.runtime.engine import Engine

MiB = 1 << 20


def weight_nbytes(w: Weight) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return int(w.nbytes)


def weight_kind(w: Weight) -> str:
    """How a prepared tensor is held: 'int4' / 'int8' codes for the kernels, else its torch dtype."""
    if isinstance(w, Int4Weight):
        return "int4"
    if isinstance(w, Int8Weight):
        return "int8"
    if isinstance(w, torch.Tensor):
        return str(w.dtype).removeprefix("torch.")
    return type(w).__name__


def component(name: str) -> str:
    """'body.2.attn_qkv.weight' -> 'body' (prelude, body, coda, embed, final_norm, ...)."""
    return name.split(".", 1)[0]


def report_load(path: object, stored: Mapping[str, Weight], prepared: Mapping[str, Weight], engine: Engine) -> None:
    """Level-2 lines: per component, tensors and bytes in the file's form and on the device; the decoder."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in prepared:
        groups[component(name)].append(name)
    detail(f"loading {path} onto {engine.device}, computing in {str(engine.dtype).removeprefix('torch.')}")
    for part, names in groups.items():
        before = sum(weight_nbytes(stored[n]) for n in names if n in stored)
        after = sum(weight_nbytes(prepared[n]) for n in names)
        was = sorted({weight_kind(stored[n]) for n in names if n in stored})
        now = sorted({weight_kind(prepared[n]) for n in names})
        detail(
            f"loaded {part}: {len(names)} tensors, {before / MiB:.2f} MiB as stored ({', '.join(was)}) -> "
            f"{after / MiB:.2f} MiB ({', '.join(now)}) on {engine.device}"
        )
    decoder = engine.decoder
    if decoder is None:
        detail("decode: the generic forward (nothing captured)")
    elif engine.device.type == "cuda":
        detail(f"decode: {type(decoder).__name__}, a CUDA graph captured per (batch, tokens, loops) on first use")
    else:
        detail(f"decode: {type(decoder).__name__}, eager on the CPU (nothing captured)")
