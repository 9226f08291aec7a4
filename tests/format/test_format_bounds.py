"""Header values the runtime cannot honour, a corrupted config, oversized headers and non-finite tensors
are refused at load with one TinyLoopFormatError naming what is wrong; tables follow the run's length."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from format_helpers import edit_header, edit_meta_json, join, split

from tinyloop.builtin import resolve_model
from tinyloop.config import MAX_LOOPS, MAX_POSITION
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format import load_weights, read_header
from tinyloop.format.header import config_crc32


def refused(path: Path, *fragments: str, load: bool = False) -> TinyLoopFormatError:
    with pytest.raises(TinyLoopFormatError) as info:
        if load:
            load_weights(path)
        else:
            read_header(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return info.value


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("embed_scale", 1e300, "[0.0001, 10000]"),
        ("embed_scale", 0, "[0.0001, 10000]"),
        ("logit_scale", 0.0, "[0.0001, 10000]"),
        ("logit_scale", -1.0, "[0.0001, 10000]"),
        ("norm_eps", 1e30, "[1e-12, 0.01]"),
        ("norm_eps", 0.0, "[1e-12, 0.01]"),
        ("rope_base", 1.5, "[100, 1e+10]"),
        ("state_init_std", 1e9, "[0, 100]"),
        ("default_loops", 16777216, f"[1, {MAX_LOOPS}]"),
        ("default_loops", 0, f"[1, {MAX_LOOPS}]"),
        ("max_position", 2**24, f"[1, {MAX_POSITION}]"),
        ("head_dim", 4096, "[2, 1024]"),
    ],
)
def test_values_out_of_range_are_refused_naming_key_and_range(
    copy_of: Callable[[str], Path], field: str, value: object, accepted: str
) -> None:
    path = copy_of("4")
    edit_meta_json(path, "config", lambda c: c.update({field: value}))
    err = refused(path, f"metadata 'config' field {field!r}", accepted)
    assert err.what == f"metadata 'config' field {field!r}"


def test_duplicate_key_inside_the_config_string(copy_of: Callable[[str], Path]) -> None:
    path = copy_of("4")

    def duplicate(doc: dict) -> None:
        text = doc["__metadata__"]["config"]
        doc["__metadata__"]["config"] = text[:-1] + ', "embed_scale": 5.0}'
        doc["__metadata__"]["config_crc32"] = config_crc32(doc["__metadata__"]["config"])

    edit_header(path, duplicate)
    refused(path, "'config'", "repeats the key 'embed_scale'")


def test_config_checksum_is_written_and_verified(copy_of: Callable[[str], Path]) -> None:
    path = copy_of("4")
    meta = read_header(path).metadata
    assert meta["config_crc32"] == config_crc32(meta["config"])

    def change_name(doc: dict) -> None:  # a valid config, changed without its checksum
        cfg = json.loads(doc["__metadata__"]["config"])
        cfg["rope_base"] = cfg["rope_base"] * 2
        doc["__metadata__"]["config"] = json.dumps(cfg)

    edit_header(path, change_name)
    refused(path, "metadata 'config'", "config_crc32")
    edit_header(path, lambda d: d["__metadata__"].update(config_crc32="XYZ"))
    refused(path, "'config_crc32'", "8 lowercase hex digits")


def test_files_without_config_checksum_still_load(copy_of: Callable[[str], Path]) -> None:
    # Files written before 1.1 (the shipped model, the test vectors) carry no checksum.
    header = read_header(resolve_model("tiny"))
    assert header.format_version == (1, 0) and "config_crc32" not in header.metadata
    path = copy_of("4")
    edit_header(path, lambda d: [d["__metadata__"].pop("config_crc32"), d["__metadata__"].update(format_version="1.0")])
    assert read_header(path).format_version == (1, 0)
    load_weights(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_float32_vector_is_refused_at_load(copy_of: Callable[[str], Path], value: float) -> None:
    path = copy_of("4")
    header = read_header(path)
    entry = header.tensors["final_norm.weight"]
    raw = bytearray(path.read_bytes())
    at = header.data_start + entry.start + 4 * 3
    raw[at : at + 4] = torch.tensor([value], dtype=torch.float32).numpy().tobytes()
    path.write_bytes(raw)
    read_header(path)  # the header is intact; the values are checked when loaded
    refused(path, "'final_norm.weight'", "finite", load=True)


def test_non_finite_dense_matrix_is_refused_at_load(copy_of: Callable[[str], Path]) -> None:
    path = copy_of("16")
    header = read_header(path)
    entry = header.tensors["embed.weight"]
    raw = bytearray(path.read_bytes())
    at = header.data_start + entry.start + 2 * 10
    raw[at : at + 2] = torch.tensor([float("inf")], dtype=torch.float16).numpy().tobytes()
    path.write_bytes(raw)
    refused(path, "'embed.weight'", "finite", load=True)


def test_a_header_of_many_entries_is_refused_before_it_is_parsed(tmp_path: Path, copy_of) -> None:
    doc, data = split(copy_of("4"))
    for i in range(20_000):
        doc[f"junk{i}"] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    path = tmp_path / "many.tinyloop"
    join(path, doc, data)
    start = time.perf_counter()
    refused(path, "at most 8192 tensor entries")
    assert time.perf_counter() - start < 2.0


def test_a_long_tensor_entry_is_refused(copy_of: Callable[[str], Path]) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["final_norm.weight"].update(shape=[0] * 5000))
    refused(path, "'final_norm.weight'", "at most 4096 characters")


@pytest.mark.parametrize("key", ["checksums", "quantization", "config"])
def test_metadata_documents_with_too_many_containers(copy_of: Callable[[str], Path], key: str) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].update({key: "[" * 20_000 + "]" * 20_000}))
    refused(path, f"metadata {key!r}", "objects and arrays")


def test_non_string_metadata_value_is_refused_without_parsing(copy_of: Callable[[str], Path]) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].update(config=[[0]] * 1000))
    refused(path, "metadata 'config'", "a string", "array")


def test_tables_follow_max_seq_len_not_max_position(tmp_path: Path, tiny_cfg, tiny_weights) -> None:
    from tinyloop.api.model import Model
    from tinyloop.format.writer import write_model
    from tinyloop.model.looped import state_noise_table

    cfg = tiny_cfg.replace(max_position=MAX_POSITION, state_start="random", state_init_std=0.5)
    path = tmp_path / "long.tinyloop"
    write_model(path, cfg, tiny_weights, bits=16, progress=False)
    start = time.perf_counter()
    with Model(path, max_seq_len=64, device="cpu") as model:
        assert time.perf_counter() - start < 10.0
        engine = model._engine
        assert engine.cos.shape[0] == 64 and engine.noise is not None and engine.noise.shape[0] == 64
        first = model.score([1, 2, 3, 4])
        model.max_seq_len = 300  # grows the tables; the rows already there stay the same
        assert engine.cos.shape[0] == 300 and engine.noise.shape[0] == 300
        assert (model.score([1, 2, 3, 4]) == first).all()
        with pytest.raises(ValueError, match=rf"max_seq_len must be an integer in \[1, {MAX_POSITION}\]"):
            model.max_seq_len = MAX_POSITION + 1
    with pytest.raises(ValueError, match=r"max_seq_len must be in \[1, 1024\]"):
        Model(tiny_path(tmp_path, tiny_cfg, tiny_weights), max_seq_len=1025, device="cpu")
    assert torch.equal(state_noise_table(cfg, 300, "cpu"), state_noise_table(cfg, 1000, "cpu")[:300])


def tiny_path(tmp_path: Path, cfg, weights) -> Path:
    from tinyloop.format.writer import write_model

    path = tmp_path / "short.tinyloop"
    write_model(path, cfg, weights, bits=16, progress=False)
    return path


def test_a_1_1_file_without_config_checksum_is_refused(copy_of: Callable[[str], Path]) -> None:
    path = copy_of("4")
    edit_header(path, lambda d: d["__metadata__"].pop("config_crc32"))
    refused(path, "metadata", "'config_crc32'", "format 1.1")


def test_position_tables_that_do_not_fit_are_out_of_memory(
    tmp_path: Path, tiny_cfg, tiny_weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinyloop.api.model import Model
    from tinyloop.cache import memory
    from tinyloop.errors import OutOfMemoryError

    path = tiny_path(tmp_path, tiny_cfg, tiny_weights)
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 100_000)  # 1024 positions need ~200 kB
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        Model(path, max_seq_len=1024, device="cpu")
    Model(path, max_seq_len=64, device="cpu").close()  # ~12 kB of tables: fits
