"""Write a `.tinyloop` file: quantize per tensor role, checksum, and replace the target atomically."""

from __future__ import annotations

import dataclasses
import os
import sys
import zlib
from collections.abc import Callable, Mapping

import torch
from tqdm import tqdm

from tinyloop.config import ArchConfig
from tinyloop.format.atomic import atomic_output
from tinyloop.format.encode import HeaderPlan
from tinyloop.format.header import ModelHeader, read_header
from tinyloop.format.reader import TORCH_DTYPES
from tinyloop.format.spec import (
    QuantInfo,
    StoredSpec,
    TensorQuant,
    is_looped,
    normalize_float_dtype,
    plan_quantization,
    stored_specs,
)
from tinyloop.layout import TensorSpec, model_specs
from tinyloop.quant import Int4Weight, Int8Weight, QuantizedWeight, quantize_int4, quantize_int8
from tinyloop.stochastic.weight import ChanneledInt4Weight

PROGRESS_MIN_BYTES = 50_000_000

Produce = Callable[[TensorSpec, TensorQuant], list[torch.Tensor]]


def check_tensor_dict(cfg: ArchConfig, tensors: Mapping[str, object]) -> list[str]:
    """Problems with a logical-name tensor dict against the config's layout (empty when it matches)."""
    specs = {s.name: s for s in model_specs(cfg)}
    problems: list[str] = []
    missing = [n for n in specs if n not in tensors]
    extra = sorted(n for n in tensors if n not in specs)
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_names(extra)}")
    for name, value in tensors.items():
        spec = specs.get(name)
        if spec is None:
            continue
        shape: tuple[int, ...]
        if isinstance(value, (Int8Weight, Int4Weight)):
            shape = value.shape
        elif isinstance(value, torch.Tensor):
            if not value.is_floating_point():
                problems.append(f"{name}: expected a floating-point tensor, found {value.dtype}")
                continue
            shape = tuple(value.shape)
        else:
            problems.append(f"{name}: expected a tensor, found {type(value).__name__}")
            continue
        if tuple(shape) != spec.shape:
            problems.append(f"{name}: expected shape {list(spec.shape)}, found {list(shape)}")
    return problems


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


def write_model(
    path: str | os.PathLike[str],
    cfg: ArchConfig,
    tensors: Mapping[str, torch.Tensor],
    bits: int = 16,
    group_size: int | None = 64,
    float_dtype: str = "F16",
    progress: bool = True,
) -> ModelHeader:
    """Quantize float weights (keyed by layout name) to `bits` and write them as a `.tinyloop` file."""
    problems = check_tensor_dict(cfg, tensors)
    if problems:
        raise ValueError("tensors do not match the config's layout: " + "; ".join(problems))
    quant = plan_quantization(cfg, bits, group_size, float_dtype)

    def produce(spec: TensorSpec, tq: TensorQuant) -> list[torch.Tensor]:
        return _quantize(spec, tq, tensors[spec.name])

    return _write(path, cfg, quant, produce, progress)


def write_model_streamed(
    path: str | os.PathLike[str],
    cfg: ArchConfig,
    source: Callable[[TensorSpec], torch.Tensor],
    bits: int = 16,
    group_size: int | None = 64,
    float_dtype: str = "F16",
    progress: bool = True,
    metadata: dict[str, str] | None = None,
) -> ModelHeader:
    """Like write_model, but `source(spec)` builds each float tensor on demand (in layout order), so only
    one logical tensor is in memory at a time (converters of multi-GB checkpoints). `metadata` adds
    optional keys such as `tokenizer`."""
    quant = plan_quantization(cfg, bits, group_size, float_dtype)

    def produce(spec: TensorSpec, tq: TensorQuant) -> list[torch.Tensor]:
        t = source(spec)
        if tuple(t.shape) != spec.shape or not t.is_floating_point():
            raise ValueError(
                f"{spec.name}: expected a float tensor of shape {list(spec.shape)}, found {t.dtype} {list(t.shape)}"
            )
        return _quantize(spec, tq, t)

    return _write(path, cfg, quant, produce, progress, metadata)


def _quantize(spec: TensorSpec, tq: TensorQuant, tensor: torch.Tensor) -> list[torch.Tensor]:
    t = tensor.detach().to("cpu")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{spec.name}: tensor holds NaN or infinite values")
    if spec.role == "vector" or tq.kind == "dense":
        return [t]
    if tq.kind == "int8":
        w8 = quantize_int8(t)
        return [w8.q, w8.scale]
    assert tq.group_size is not None
    w4 = quantize_int4(t, tq.group_size)
    return [w4.packed, w4.scale, w4.minimum]


def write_quantized(
    path: str | os.PathLike[str],
    cfg: ArchConfig,
    weights: Mapping[str, torch.Tensor | QuantizedWeight],
    float_dtype: str = "F16",
    progress: bool = True,
    metadata: dict[str, str] | None = None,
) -> ModelHeader:
    """Write weights as they are (e.g. what load_weights returned): INT8/INT4 objects keep their layout,
    rounding channels included (which makes a 2.0 file). `metadata` adds optional keys (`tokenizer`, `x-*`)."""
    problems = check_tensor_dict(cfg, weights)
    if problems:
        raise ValueError("weights do not match the config's layout: " + "; ".join(problems))
    kinds: dict[str, TensorQuant] = {}
    for spec in model_specs(cfg):
        w = weights[spec.name]
        if spec.role == "vector" and not isinstance(w, torch.Tensor):
            raise ValueError(f"{spec.name}: norms and biases must be float tensors, found {type(w).__name__}")
        if isinstance(w, ChanneledInt4Weight):
            if spec.role != "linear" or not is_looped(spec.name):
                raise ValueError(f"{spec.name}: rounding channels are only for looped matrices (body.*, adapter)")
            kinds[spec.name] = TensorQuant("int4", w.group_size, w.channel_kind)
        elif isinstance(w, Int4Weight):
            kinds[spec.name] = TensorQuant("int4", w.group_size)
        elif isinstance(w, Int8Weight):
            kinds[spec.name] = TensorQuant("int8")
        else:
            kinds[spec.name] = TensorQuant("dense")
    groups = sorted({tq.group_size for tq in kinds.values() if tq.group_size is not None})
    present = {tq.kind for tq in kinds.values()}
    bits = 4 if "int4" in present else 8 if "int8" in present else 16
    quant = QuantInfo(bits, groups[0] if groups else None, normalize_float_dtype(float_dtype), kinds)

    def produce(spec: TensorSpec, tq: TensorQuant) -> list[torch.Tensor]:
        w = weights[spec.name]
        if isinstance(w, ChanneledInt4Weight):
            return [w.packed, w.scale, w.minimum, w.channel]
        if isinstance(w, Int4Weight):
            return [w.packed, w.scale, w.minimum]
        if isinstance(w, Int8Weight):
            return [w.q, w.scale]
        return [w.detach()]

    return _write(path, cfg, quant, produce, progress, metadata)


def _write(
    path: str | os.PathLike[str],
    cfg: ArchConfig,
    quant: QuantInfo,
    produce: Produce,
    progress: bool,
    metadata: dict[str, str] | None = None,
) -> ModelHeader:
    if sys.byteorder != "little":
        raise RuntimeError("writing .tinyloop files needs a little-endian machine")
    path = os.fspath(path)
    plan = HeaderPlan(cfg, quant, metadata)
    checksums: dict[str, str] = {}
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as f, _progress_bar(path, plan.data_bytes, progress) as bar:
            f.truncate(plan.data_start + plan.data_bytes)
            # One logical tensor at a time: only its quantized copy is alive besides the input.
            for spec in model_specs(cfg):
                tq = quant.tensors[spec.name]
                arrays = produce(spec, tq)
                for s, t in zip(stored_specs(spec, tq, quant.float_dtype), arrays, strict=True):
                    data = _as_bytes(s, t)
                    checksums[s.name] = f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
                    f.seek(plan.data_start + plan.offsets[s.name][0])
                    f.write(data)
                    bar.update(s.nbytes)
                del arrays
            prefix = plan.prefix(checksums)
            assert len(prefix) == plan.data_start
            f.seek(0)
            f.write(prefix)
            f.flush()
            os.fsync(f.fileno())
        # Validate before publishing, so a bad file never replaces a good one.
        written = read_header(tmp)
    return dataclasses.replace(written, path=path)


def _as_bytes(s: StoredSpec, t: torch.Tensor) -> memoryview:
    """The stored bytes of one tensor, converted to its stored dtype and checked."""
    if tuple(t.shape) != s.shape:
        raise ValueError(f"{s.name}: expected shape {list(s.shape)}, found {list(t.shape)}")
    want = TORCH_DTYPES[s.dtype]
    if t.is_floating_point() != want.is_floating_point:
        raise ValueError(f"{s.name}: expected dtype {want}, found {t.dtype}")
    t = t.detach().to(device="cpu", dtype=want).contiguous()
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{s.name}: values overflow {s.dtype} (NaN or infinite after conversion)")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _progress_bar(path: str, total: int, enabled: bool) -> tqdm:
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"writing {os.path.basename(path)}",
        file=sys.stderr,
        disable=not enabled or total < PROGRESS_MIN_BYTES,
    )
