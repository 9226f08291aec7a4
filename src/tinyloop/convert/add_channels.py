"""Adds rounding channels, computed from the original float weights, to a `.tinyloop` file's looped INT4 matrices."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tinyloop.convert.from_checkpoint import load_checkpoint
from tinyloop.convert.weight_shards import load_weight_shards
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.header import ModelHeader
from tinyloop.format.reader import load_weights
from tinyloop.format.spec import OPTIONAL_METADATA, is_looped
from tinyloop.format.writer import check_tensor_dict, write_quantized
from tinyloop.layout import model_specs
from tinyloop.quant import Int4Weight
from tinyloop.stochastic.channels import FRAC_BITS, encode_channel, rounding_residual
from tinyloop.stochastic.weight import ChanneledInt4Weight

# The stored codes must be the nearest rounding of the checkpoint: a residual past half a step (beyond
# float noise) means the file was quantized from other weights.
RESIDUAL_SLACK = 1e-3
MAX_MISMATCH_SHARE = 1e-3


@dataclass(frozen=True)
class ChannelReport:
    """What add_rounding_channels wrote: one channel per looped INT4 matrix."""

    header: ModelHeader
    channel: str
    matrices: list[str]
    weights: int
    mean_abs_residual: float  # in quantization steps; 1/4 for uniformly spread residuals


def load_float_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Name -> tensor from a torch .pt state dict, a .safetensors file, or sharded training output
    (a shard, its index JSON, or the directory holding them)."""
    p = Path(path)
    sharded = p.is_dir() or p.suffix == ".json" or (p.suffix == ".safetensors" and "-of-" in p.name)
    if not sharded:
        return load_checkpoint(p)
    try:
        return load_weight_shards(p)[1]
    except (OSError, ValueError, KeyError) as exc:
        raise TinyLoopFormatError(p, "checkpoint", "loadable sharded weights", f"{type(exc).__name__}: {exc}") from None


def add_rounding_channels(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    frac_bits: int = 1,
    progress: bool = True,
) -> ChannelReport:
    """Write `dst`: `src` with a `sign` (frac_bits 1) or `frac4` (4) channel on every looped INT4 matrix.

    The checkpoint must hold exactly the model's tensors (names and shapes), and `src`'s INT4 codes must
    be the nearest rounding of its weights; anything else is refused. Existing channels are replaced.
    """
    if frac_bits not in FRAC_BITS:
        raise ValueError(f"frac_bits must be one of {sorted(FRAC_BITS)}, got {frac_bits!r}")
    kind = FRAC_BITS[frac_bits]
    header, flat = load_weights(src)
    cfg = header.config
    floats = load_float_checkpoint(checkpoint)
    problems = check_tensor_dict(cfg, floats)
    if problems:
        raise TinyLoopFormatError(checkpoint, "tensors", f"the layout of {os.fspath(src)}", "; ".join(problems))
    targets = [s.name for s in model_specs(cfg) if is_looped(s.name) and isinstance(flat[s.name], Int4Weight)]
    if not targets:
        raise ValueError(f"{os.fspath(src)} has no INT4 looped matrices; convert it with --bits 4 first")
    out = dict(flat)
    total, abs_sum = 0, 0.0
    for name in tqdm(targets, desc=f"{kind} channels", file=sys.stderr, disable=not progress):
        w4 = flat[name]
        assert isinstance(w4, Int4Weight)
        residual = rounding_residual(floats[name], w4)
        off = int((residual.abs() > 0.5 + RESIDUAL_SLACK).sum())
        if off > MAX_MISMATCH_SHARE * residual.numel():
            raise TinyLoopFormatError(
                checkpoint,
                f"tensor {name!r}",
                f"the float weights {os.fspath(src)} was quantized from (every INT4 code within half a step)",
                f"{off} of {residual.numel()} weights further away",
            )
        channel = encode_channel(residual, kind)
        out[name] = ChanneledInt4Weight(w4.packed, w4.scale, w4.minimum, w4.group_size, channel, kind)
        total += residual.numel()
        abs_sum += float(residual.abs().sum())
    metadata = {k: v for k, v in header.metadata.items() if k in OPTIONAL_METADATA or k.startswith("x-")}
    written = write_quantized(dst, cfg, out, header.quantization.float_dtype, progress, metadata)
    return ChannelReport(written, kind, targets, total, abs_sum / total)
