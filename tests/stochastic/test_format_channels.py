"""Format 2.0 rounding channels: round trip, version rules, and what the reader refuses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tinyloop.errors import TinyLoopFormatError
from tinyloop.format import header as header_module
from tinyloop.format.header import read_header
from tinyloop.format.reader import load_weights, verify_checksums
from tinyloop.format.writer import write_quantized
from tinyloop.quant import Int4Weight
from tinyloop.stochastic.weight import ChanneledInt4Weight

QKV = "body.0.attn.qkv.weight"


def edit(
    path: Path, fn: Callable[[dict[str, Any]], None], quant: Callable[[dict[str, Any]], None] | None = None
) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8 : 8 + n])
    fn(doc)
    if quant is not None:
        q = json.loads(doc["__metadata__"]["quantization"])
        quant(q)
        doc["__metadata__"]["quantization"] = json.dumps(q)
    text = json.dumps(doc).encode()
    text += b" " * (-(8 + len(text)) % 64)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    dst.write_bytes(src.read_bytes())
    return dst


@pytest.mark.parametrize("kind", ["sign", "frac4"])
def test_round_trip(files: dict[str, Path], tmp_path: Path, kind: str) -> None:
    h = read_header(files[kind])
    assert h.format_version_str == "2.1"
    looped = [n for n, tq in h.quantization.tensors.items() if tq.channel is not None]
    assert looped and all(n.startswith("body.") or n == "adapter.weight" for n in looped)
    assert all(tq.channel == kind for n, tq in h.quantization.tensors.items() if n in looped)
    assert f"{QKV}.{kind}" in h.tensors and verify_checksums(files[kind]) == []
    _, w = load_weights(files[kind])
    _, plain = load_weights(files["int4"])
    qkv = w[QKV]
    assert isinstance(qkv, ChanneledInt4Weight) and qkv.channel_kind == kind
    # Channels are extra: the INT4 part is the input file's, and unaware code sees plain INT4.
    assert torch.equal(qkv.dequantize(), plain[QKV].dequantize())
    assert type(w["prelude.0.attn.qkv.weight"]) is Int4Weight
    again = tmp_path / "again.tinyloop"
    write_quantized(again, h.config, w, h.quantization.float_dtype, progress=False)
    assert again.read_bytes() == files[kind].read_bytes()


def test_files_without_channels_stay_1_x(files: dict[str, Path], tmp_path: Path) -> None:
    h, w = load_weights(files["int4"])
    assert h.format_version_str == "1.1"
    out = tmp_path / "plain.tinyloop"
    write_quantized(out, h.config, w, progress=False)
    assert read_header(out).format_version_str == "1.1"


def test_a_1_0_reader_refuses_with_upgrade(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # What this version's reader did before 2.0 existed: it knew major version 1 only.
    monkeypatch.setattr(header_module, "READ_VERSIONS", {1: 0})
    with pytest.raises(TinyLoopFormatError, match="upgrade tinyloop") as err:
        read_header(files["sign"])
    assert err.value.found == "2.1"
    read_header(files["int4"])


def test_newer_major_refused(files: dict[str, Path], tmp_path: Path) -> None:
    path = copy(files["frac4"], tmp_path)
    edit(path, lambda d: d["__metadata__"].update(format_version="3.0"))
    with pytest.raises(TinyLoopFormatError, match="reads 1.1 and 2.1; upgrade tinyloop"):
        read_header(path)


def test_channel_in_a_1_0_file_refused(files: dict[str, Path], tmp_path: Path) -> None:
    path = copy(files["sign"], tmp_path)
    edit(path, lambda d: d["__metadata__"].update(format_version="1.0"))
    with pytest.raises(TinyLoopFormatError, match="needs format_version 2.0"):
        read_header(path)


def _set_channel(name: str, value: object) -> Callable[[dict[str, Any]], None]:
    def go(q: dict[str, Any]) -> None:
        q["tensors"][name]["channel"] = value

    return go


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        (QKV, "frac8", "one of \\['sign', 'frac4'\\]"),
        ("prelude.0.attn.qkv.weight", "sign", "only on int4 looped matrices"),
        ("body.0.attn_norm.weight", "sign", "only on int4 looped matrices"),
    ],
)
def test_bad_channel_entries_refused(files: dict[str, Path], tmp_path: Path, name: str, value: str, match: str) -> None:
    path = copy(files["sign"], tmp_path)
    edit(path, lambda d: None, _set_channel(name, value))
    with pytest.raises(TinyLoopFormatError, match=match):
        read_header(path)


def test_missing_or_mistyped_channel_tensor_refused(files: dict[str, Path], tmp_path: Path) -> None:
    path = copy(files["sign"], tmp_path)
    edit(path, lambda d: None, _set_channel(QKV, "frac4"))  # header says frac4, the file stores .sign
    with pytest.raises(TinyLoopFormatError, match="missing"):
        read_header(path)
    path = copy(files["frac4"], tmp_path)
    edit(path, lambda d: d[f"{QKV}.frac4"].update(shape=[1, 1]))
    with pytest.raises(TinyLoopFormatError, match="shape"):
        read_header(path)


def test_writer_refuses_channels_outside_the_loop(files: dict[str, Path], tmp_path: Path) -> None:
    h, w = load_weights(files["sign"])
    src = w[QKV]
    assert isinstance(src, ChanneledInt4Weight)
    target = w["prelude.0.attn.qkv.weight"]
    assert isinstance(target, Int4Weight)
    w["prelude.0.attn.qkv.weight"] = ChanneledInt4Weight(
        target.packed, target.scale, target.minimum, target.group_size, src.channel, "sign"
    )
    with pytest.raises(ValueError, match="only for looped matrices"):
        write_quantized(tmp_path / "bad.tinyloop", h.config, w, progress=False)
    assert not (tmp_path / "bad.tinyloop").exists()
