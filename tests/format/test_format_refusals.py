"""Every way a file can be wrong gives one TinyLoopFormatError naming the file and the problem."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from format_helpers import data_start, edit_header, edit_meta_json, join, split

from tinyloop.errors import TinyLoopFormatError
from tinyloop.format import load_weights, read_header


def refused(path: Path, *fragments: str) -> TinyLoopFormatError:
    with pytest.raises(TinyLoopFormatError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return info.value


def test_wrong_format_name(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].update(format="gguf"))
    refused(path, "'format'", "gguf")


def test_plain_safetensors_file(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d.pop("__metadata__"))
    refused(path, "__metadata__")


def test_newer_major_version(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].update(format_version="3.0"))
    err = refused(path, "format_version", "upgrade")
    assert err.found == "3.0"


@pytest.mark.parametrize("version", ["1", "1.0.0", "v1.0", "01.0", "", "0.9"])
def test_malformed_or_old_version(copy_of, version: str) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].update(format_version=version))
    refused(path, "format_version")


def test_newer_minor_is_readable_and_ignores_new_keys(copy_of) -> None:
    path = copy_of("4")

    def bump(doc: dict) -> None:
        doc["__metadata__"].update({"format_version": "1.7", "some_future_key": "{}"})

    edit_header(path, bump)
    header = read_header(path)
    assert header.format_version == (1, 7)
    load_weights(path)


def test_unknown_metadata_keys(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].update({"x-origin": "test"}))
    read_header(path)
    edit_header(path, lambda d: d["__metadata__"].update({"surprise": "1"}))
    refused(path, "surprise")
    # `tokenizer` is defined (docs/format.md 2.3) and validated, no longer free-form.
    edit_header(path, lambda d: (d["__metadata__"].pop("surprise"), d["__metadata__"].update({"tokenizer": "x"})))
    refused(path, "tokenizer")


def test_missing_required_metadata(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].pop("checksums"))
    refused(path, "checksums")


def test_missing_tensor(copy_of) -> None:
    path = copy_of("4")
    doc, data = split(path)
    last = max((k for k in doc if k != "__metadata__"), key=lambda k: doc[k]["data_offsets"][1])
    begin, _ = doc.pop(last)["data_offsets"]
    join(path, doc, data[:begin])
    refused(path, "missing", last)


def test_extra_tensor(copy_of) -> None:
    path = copy_of("4")
    doc, data = split(path)
    end = len(data)
    doc["bogus.weight"] = {"dtype": "U8", "shape": [4], "data_offsets": [end, end + 4]}
    join(path, doc, data + b"\0" * 4)
    refused(path, "extra", "bogus.weight")


def test_wrong_shape(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["final_norm.weight"].update(shape=[32, 2]))
    refused(path, "final_norm.weight", "shape", "[64]", "[32, 2]")


def test_wrong_dtype(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["final_norm.weight"].update(dtype="F16"))
    refused(path, "final_norm.weight", "dtype", "F32", "F16")


def test_unknown_dtype(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["final_norm.weight"].update(dtype="F64"))
    refused(path, "final_norm.weight", "dtype")


def test_truncated_file(copy_of) -> None:
    path = copy_of("4")
    path.write_bytes(path.read_bytes()[:-1])
    refused(path, "truncated")


def test_trailing_garbage(copy_of) -> None:
    path = copy_of("4")
    path.write_bytes(path.read_bytes() + b"garbage")
    refused(path, "trailing")


@pytest.mark.parametrize("n", [2**40, 64 * 1024 * 1024 + 1])
def test_oversized_header_length(copy_of, n: int) -> None:
    path = copy_of("4")
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", n)
    path.write_bytes(raw)
    refused(path, "header length")


def test_tiny_files(tmp_path: Path) -> None:
    path = tmp_path / "m.tinyloop"
    for content in (b"", b"\1\0\0", struct.pack("<Q", 0), struct.pack("<Q", 2) + b"{}"):
        path.write_bytes(content)
        refused(path)


def test_header_not_json(copy_of) -> None:
    path = copy_of("4")
    raw = bytearray(path.read_bytes())
    raw[8:40] = b"this is not json at all.........".ljust(32)
    path.write_bytes(raw)
    refused(path, "JSON")


def test_header_not_utf8(copy_of) -> None:
    path = copy_of("4")
    raw = bytearray(path.read_bytes())
    raw[9] = 0xFF
    path.write_bytes(raw)
    refused(path, "UTF-8")


def test_deeply_nested_header(tmp_path: Path) -> None:
    path = tmp_path / "m.tinyloop"
    header = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    refused(path, "JSON")


def test_duplicate_keys(copy_of) -> None:
    path = copy_of("4")
    doc, data = split(path)
    text = json.dumps(doc)
    text = text.replace('{"__metadata__": {', '{"__metadata__": {"format": "tinyloop", ', 1)
    header = text.encode() + b" " * (-(8 + len(text)) % 64)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    refused(path, "duplicate")


def test_misaligned_data_section(copy_of) -> None:
    path = copy_of("4")
    doc, data = split(path)
    header = json.dumps(doc).encode()
    header += b" " * (1 - min(1, (8 + len(header)) % 8))  # one trailing space when it would land aligned
    assert (8 + len(header)) % 8
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    refused(path, "multiple of 8")


def test_overlapping_and_gapped_offsets(copy_of) -> None:
    path = copy_of("4")
    doc, data = split(path)
    first = min((k for k in doc if k != "__metadata__"), key=lambda k: doc[k]["data_offsets"][0])
    doc[first]["data_offsets"] = [64, 64 + doc[first]["data_offsets"][1]]
    join(path, doc, data)
    refused(path, first, "data_offsets")


@pytest.mark.parametrize(
    ("field", "value"),
    [("d_model", "64"), ("n_heads", 0), ("ffn_kind", "relu"), ("norm_eps", 10**400), ("unknown_field", 1)],
)
def test_bad_config_field(copy_of, field: str, value: object) -> None:
    path = copy_of("4")
    edit_meta_json(path, "config", lambda c: c.update({field: value}))
    refused(path, "'config'", field)


def test_config_with_absurd_layer_count(copy_of) -> None:
    path = copy_of("4")
    edit_meta_json(path, "config", lambda c: c.update(n_body=200))
    refused(path, "layers")
    edit_meta_json(path, "config", lambda c: c.update(n_body=2**24))
    refused(path, "'n_body'", "[1, 256]")


def test_config_not_json(copy_of) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].update(config="{nope"))
    refused(path, "'config'")


def test_quantization_inconsistent_with_layout(copy_of) -> None:
    path = copy_of("4")
    edit_meta_json(path, "quantization", lambda q: q["tensors"]["final_norm.weight"].update(kind="int8"))
    refused(path, "final_norm.weight", "dense")
    path = copy_of("4")
    edit_meta_json(path, "quantization", lambda q: q["tensors"].pop("embed.weight"))
    refused(path, "embed.weight", "missing")
    path = copy_of("4")
    edit_meta_json(path, "quantization", lambda q: q["tensors"]["embed.weight"].update(group_size=48))
    refused(path, "embed.weight", "group_size")
    path = copy_of("8")
    edit_meta_json(path, "quantization", lambda q: q.update(bits=16))
    refused(path, "kind")


def test_kind_change_without_tensor_change(copy_of) -> None:
    # The quantization map says dense but the stored tensors are INT4.
    path = copy_of("4")
    edit_meta_json(path, "quantization", lambda q: q["tensors"]["embed.weight"].update(kind="dense", group_size=None))
    refused(path, "embed.weight")


def test_bad_checksums(copy_of) -> None:
    path = copy_of("4")
    edit_meta_json(path, "checksums", lambda c: c.update({"embed.weight.q4": "XYZ"}))
    refused(path, "checksums", "embed.weight.q4")
    path = copy_of("4")
    edit_meta_json(path, "checksums", lambda c: c.pop("embed.weight.q4"))
    refused(path, "checksums", "embed.weight.q4")


def test_missing_file(tmp_path: Path) -> None:
    refused(tmp_path / "nope.tinyloop", "readable")
    refused(tmp_path, "readable")


@pytest.mark.parametrize(
    ("key", "suffix", "bad"), [("8", "scale", 0x7E00), ("4", "scale", 0x7C00), ("4", "min", 0xFC00)]
)
def test_non_finite_scales(copy_of, key: str, suffix: str, bad: int) -> None:
    path = copy_of(key)
    name = f"body.1.mlp.down.weight.{suffix}"
    entry = read_header(path).tensors[name]
    raw = bytearray(path.read_bytes())
    offset = data_start(path) + entry.start + 2 * 3
    raw[offset : offset + 2] = struct.pack("<H", bad)
    path.write_bytes(raw)
    read_header(path)  # the header is fine; only loading looks at the values
    with pytest.raises(TinyLoopFormatError, match=name.replace(".", r"\.")):
        load_weights(path)


def test_file_changed_after_header_read(copy_of) -> None:
    path = copy_of("4")
    header = read_header(path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(TinyLoopFormatError, match="file size"):
        load_weights(path, header=header)
