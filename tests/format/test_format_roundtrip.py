"""Write -> read round trips at every bit width, group size and float dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tinyloop.config import ArchConfig
from tinyloop.format import load_weights, read_header, write_model, write_quantized
from tinyloop.format.reader import TORCH_DTYPES
from tinyloop.layout import model_specs
from tinyloop.quant import Int4Weight, Int8Weight, quantize_int4, quantize_int8


def rel_fro(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("float_dtype", ["F16", "BF16", "F32"])
def test_dense_round_trip_is_exact(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights, float_dtype: str) -> None:
    path = tmp_path / "m.tinyloop"
    write_model(path, tiny_cfg, tiny_weights, bits=16, float_dtype=float_dtype.lower(), progress=False)
    header, weights = load_weights(path)
    assert header.quantization.bits == 16 and header.quantization.float_dtype == float_dtype
    for spec in model_specs(tiny_cfg):
        got = weights[spec.name]
        assert isinstance(got, torch.Tensor)
        want_dtype = torch.float32 if spec.role == "vector" else TORCH_DTYPES[float_dtype]
        assert got.dtype == want_dtype and tuple(got.shape) == spec.shape
        assert torch.equal(got, tiny_weights[spec.name].to(want_dtype)), spec.name


def test_int8_round_trip_matches_quant(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights) -> None:
    path = tmp_path / "m.tinyloop"
    write_model(path, tiny_cfg, tiny_weights, bits=8, progress=False)
    header, weights = load_weights(path)
    assert header.quantization.group_size is None
    for spec in model_specs(tiny_cfg):
        got = weights[spec.name]
        if spec.role == "vector":
            assert isinstance(got, torch.Tensor) and torch.equal(got, tiny_weights[spec.name])
            continue
        assert isinstance(got, Int8Weight)
        ref = quantize_int8(tiny_weights[spec.name])
        assert torch.equal(got.q, ref.q) and torch.equal(got.scale, ref.scale)
        assert rel_fro(got.dequantize(), tiny_weights[spec.name]) < 0.01


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_matches_quant(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights, group_size: int) -> None:
    path = tmp_path / "m.tinyloop"
    write_model(path, tiny_cfg, tiny_weights, bits=4, group_size=group_size, progress=False)
    header, weights = load_weights(path)
    assert header.quantization.group_size == group_size
    for spec in model_specs(tiny_cfg):
        got = weights[spec.name]
        w = tiny_weights[spec.name]
        if spec.role == "vector":
            assert isinstance(got, torch.Tensor) and torch.equal(got, w)
        elif spec.shape[1] % group_size:
            # in_features not divisible by the group: the writer falls back to INT8.
            assert isinstance(got, Int8Weight)
            assert header.quantization.tensors[spec.name].kind == "int8"
        else:
            assert isinstance(got, Int4Weight) and got.group_size == group_size
            ref = quantize_int4(w, group_size)
            assert torch.equal(got.packed, ref.packed)
            assert torch.equal(got.scale, ref.scale) and torch.equal(got.minimum, ref.minimum)
            assert rel_fro(got.dequantize(), w) < 0.15
            # Half a quantization step is the worst case per element, plus FP16 rounding of scale/min.
            step = got.scale.float().repeat_interleave(group_size, dim=1)
            assert bool(((got.dequantize() - w).abs() <= step * 0.5 + 1e-3).all())
    if group_size == 128:
        assert header.quantization.counts()["int8"] > 0


def test_layout_is_aligned_and_safetensors_compatible(format_files: dict[str, Path]) -> None:
    for path in format_files.values():
        header = read_header(path)
        assert header.data_start % 64 == 0
        for entry in header.tensors.values():
            if entry.nbytes % 64 == 0:
                assert entry.start % 64 == 0, entry.name
        _, weights = load_weights(path)
        with safe_open(str(path), framework="pt") as f:
            assert set(f.keys()) == set(header.tensors)
            assert f.metadata() == header.metadata
            for name, entry in header.tensors.items():
                t = f.get_tensor(name)
                assert t.dtype == TORCH_DTYPES[entry.dtype] and tuple(t.shape) == entry.shape


def test_loaded_weights_do_not_depend_on_the_file(format_files: dict[str, Path], tmp_path: Path) -> None:
    # Rewriting (same size) or truncating the file after loading changes nothing and cannot fault.
    path = tmp_path / "model.tinyloop"
    path.write_bytes(format_files["16"].read_bytes())
    header, weights = load_weights(path)
    before = {n: w.clone() for n, w in weights.items() if isinstance(w, torch.Tensor)}
    raw = bytearray(path.read_bytes())
    raw[header.data_start :] = bytes(len(raw) - header.data_start)
    path.write_bytes(raw)  # same size, every weight zeroed
    for name, t in before.items():
        assert torch.equal(weights[name], t), name
    with open(path, "r+b") as f:
        f.truncate(header.data_start)
    assert all(float(w.float().abs().sum()) == float(before[n].float().abs().sum()) for n, w in before.items())
    path.unlink()
    assert all(torch.equal(weights[n], t) for n, t in before.items())


def test_write_quantized_round_trips(tmp_path: Path, format_files: dict[str, Path], tiny_cfg: ArchConfig) -> None:
    header, weights = load_weights(format_files["4"])
    again = write_quantized(tmp_path / "again.tinyloop", tiny_cfg, weights, progress=False)
    assert again.quantization == header.quantization
    assert (tmp_path / "again.tinyloop").read_bytes() == format_files["4"].read_bytes()


def test_header_fields(format_files: dict[str, Path], tiny_cfg: ArchConfig) -> None:
    header = read_header(format_files["4"])
    assert header.config == tiny_cfg
    assert header.format_version == (1, 1) and header.format_version_str == "1.1"
    assert header.file_size == format_files["4"].stat().st_size
    assert header.weight_bytes == sum(e.nbytes for e in header.tensors.values())
    assert set(header.checksums) == set(header.tensors)
    assert header.metadata["format"] == "tinyloop"


def test_writer_rejects_mismatched_dicts(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights) -> None:
    bad = dict(tiny_weights)
    del bad["embed.weight"]
    bad["bogus.weight"] = torch.zeros(3)
    bad["final_norm.weight"] = torch.zeros(7)
    with pytest.raises(ValueError) as info:
        write_model(tmp_path / "m.tinyloop", tiny_cfg, bad, progress=False)
    message = str(info.value)
    assert "embed.weight" in message and "bogus.weight" in message and "final_norm.weight" in message
    with pytest.raises(ValueError, match="bits"):
        write_model(tmp_path / "m.tinyloop", tiny_cfg, tiny_weights, bits=3, progress=False)
    with pytest.raises(ValueError, match="group size"):
        write_model(tmp_path / "m.tinyloop", tiny_cfg, tiny_weights, bits=4, group_size=48, progress=False)
    with pytest.raises(ValueError, match="float dtype"):
        write_model(tmp_path / "m.tinyloop", tiny_cfg, tiny_weights, float_dtype="f8", progress=False)
    huge = dict(tiny_weights, **{"embed.weight": torch.full(tuple(tiny_weights["embed.weight"].shape), 1e6)})
    with pytest.raises(ValueError, match="embed.weight"):
        write_model(tmp_path / "m.tinyloop", tiny_cfg, huge, bits=16, progress=False)
    assert list(tmp_path.iterdir()) == []
