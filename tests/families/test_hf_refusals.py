"""Malformed Hugging Face folders fail with one TinyLoopFormatError naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_helpers import copy_vectors
from safetensors.torch import load_file, save_file

from file_fuzz import fuzz_hf_folders
from tinyloop.cli.convert import main as convert_main
from tinyloop.convert.from_hf import convert_hf
from tinyloop.errors import TinyLoopFormatError


def _convert(folder: Path, tmp_path: Path) -> None:
    convert_hf(folder, tmp_path / "out.tinyloop", progress=False)


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _shard(folder: Path, family: str) -> None:
    """Split model.safetensors into two shards with an index, as save_pretrained does for big models."""
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_sharded_folder_converts_to_the_same_file(tmp_path: Path, family: str) -> None:
    single = copy_vectors(family, tmp_path / "single", tokenizer=False)
    sharded = copy_vectors(family, tmp_path / "sharded", tokenizer=False)
    _shard(sharded, family)
    a = convert_hf(single, tmp_path / "a.tinyloop", progress=False)
    b = convert_hf(sharded, tmp_path / "b.tinyloop", progress=False)
    assert a.checksums == b.checksums


def test_missing_shard(tmp_path: Path) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    _shard(folder, "ouro")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(TinyLoopFormatError, match=r"shards: .*missing \['model-00002-of-00002.safetensors'\]"):
        _convert(folder, tmp_path)


def test_missing_config(tmp_path: Path) -> None:
    folder = copy_vectors("huginn", tmp_path / "hf", tokenizer=False)
    (folder / "config.json").unlink()
    with pytest.raises(TinyLoopFormatError, match="config.json: expected a JSON file in the model folder"):
        _convert(folder, tmp_path)


def test_unknown_model_type(tmp_path: Path) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    _edit_config(folder, model_type="llama")
    with pytest.raises(TinyLoopFormatError, match=r"model_type'.*\['huginn_raven', 'ouro'\].*'llama'"):
        _convert(folder, tmp_path)


def test_wrong_shape(tmp_path: Path) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(170, 64)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(TinyLoopFormatError, match=r"'model.layers.1.mlp.up_proj.weight'.*\[176, 64\].*\[170, 64\]"):
        _convert(folder, tmp_path)


def test_missing_and_unknown_tensors(tmp_path: Path) -> None:
    folder = copy_vectors("huginn", tmp_path / "hf", tokenizer=False)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["transformer.core_block.1.attn.qk_bias"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(TinyLoopFormatError, match=r"missing transformer.core_block.1.attn.qk_bias"):
        _convert(folder, tmp_path)
    tensors["transformer.core_block.1.attn.qk_bias"] = torch.zeros(2, 1, 4, 16)
    tensors["transformer.core_block.1.attn.extra_scale"] = torch.ones(4)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(TinyLoopFormatError, match=r"unknown transformer.core_block.1.attn.extra_scale"):
        _convert(folder, tmp_path)


def test_huginn_untied_head_is_refused_and_a_copy_is_accepted(tmp_path: Path) -> None:
    folder = copy_vectors("huginn", tmp_path / "hf", tokenizer=False)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    _convert(folder, tmp_path)  # the released layout: two identical copies
    tensors["lm_head.weight"][3, 5] += 1.0
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(TinyLoopFormatError, match="lm_head.weight.*different values"):
        _convert(folder, tmp_path)


def test_unsupported_config_value(tmp_path: Path) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    _edit_config(folder, rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(TinyLoopFormatError, match="rope_scaling"):
        _convert(folder, tmp_path)


def test_cli_reports_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    (folder / "model.safetensors").unlink()
    code = convert_main(["--from-hf", str(folder), "-o", str(tmp_path / "x.tinyloop"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "weights: expected model.safetensors or model.safetensors.index.json, found neither" in err
    assert not (tmp_path / "x.tinyloop").exists()
    assert convert_main(["--from-hf", str(folder), "--random", "-o", str(tmp_path / "x.tinyloop")]) == 2


@pytest.mark.parametrize("shard", ["../elsewhere/model.safetensors", "/etc/passwd", "a/../../x.safetensors", 7, ""])
def test_index_pointing_outside_the_folder_is_refused(tmp_path: Path, shard: object) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    _shard(folder, "ouro")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes((folder / "model-00001-of-00002.safetensors").read_bytes())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TinyLoopFormatError, match=r"weight_map'.*inside the model folder"):
        _convert(folder, tmp_path)


def _edit_shard_header(path: Path, fn) -> None:  # type: ignore[no-untyped-def]
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8 : 8 + n])
    fn(doc)
    header = json.dumps(doc).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n :])


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([-8, 0], "data_offsets"),
        ([0, -4], "data_offsets"),
        ([0, 2**62], "data_offsets"),
        ([4, 0], "data_offsets"),
        ("0-4", "data_offsets"),
        ([0, 4], "bytes"),  # inside the file, but not the tensor's size
    ],
)
def test_bad_offsets_in_a_shard_are_one_error(tmp_path: Path, offsets: object, message: str) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    _edit_shard_header(folder / "model.safetensors", lambda d: d["model.norm.weight"].update(data_offsets=offsets))
    with pytest.raises(TinyLoopFormatError, match=rf"model.safetensors tensor 'model.norm.weight'.*{message}"):
        _convert(folder, tmp_path)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["model.norm.weight"].update(shape="64"),
        lambda d: d["model.norm.weight"].update(shape=[-64]),
        lambda d: d["model.norm.weight"].update(dtype="F8"),
        lambda d: d.update({"model.norm.weight": [1, 2]}),
    ],
)
def test_bad_shard_entries_are_one_error(tmp_path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    _edit_shard_header(folder / "model.safetensors", edit)
    with pytest.raises(TinyLoopFormatError, match="model.norm.weight"):
        _convert(folder, tmp_path)


def test_duplicate_keys_in_config_json(tmp_path: Path) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    text = (folder / "config.json").read_text().rstrip().rstrip("}") + ', "hidden_size": 128}'
    (folder / "config.json").write_text(text)
    with pytest.raises(TinyLoopFormatError, match="config.json.*duplicate key 'hidden_size'"):
        _convert(folder, tmp_path)


def test_tensor_in_two_shards(tmp_path: Path) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    _shard(folder, "ouro")
    second = load_file(str(folder / "model-00002-of-00002.safetensors"))
    first = load_file(str(folder / "model-00001-of-00002.safetensors"))
    name = next(iter(first))
    second[name] = first[name]
    save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    with pytest.raises(TinyLoopFormatError, match=f"'{name}'.*one shard"):
        _convert(folder, tmp_path)


def test_hf_cache_style_symlinked_shards_convert(tmp_path: Path) -> None:
    folder = copy_vectors("ouro", tmp_path / "hf", tokenizer=False)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (folder / "model.safetensors").rename(blobs / "abc123")
    (folder / "model.safetensors").symlink_to(Path("..") / "blobs" / "abc123")
    _convert(folder, tmp_path)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_seeded_hf_folder_mutations(tmp_path: Path, family: str) -> None:
    """config.json edits, shard header edits, index entries pointing elsewhere, truncated shards, flipped header
    bits (half of the folders sharded): each is refused with TinyLoopFormatError or converts; a conversion differs
    from the unmutated folder's only when a config.json value changed to another valid one."""
    folder = copy_vectors(family, tmp_path / "source", tokenizer=False)
    outcomes = fuzz_hf_folders(folder, tmp_path, 60, seed=7)
    assert outcomes["refused"] > 20 and outcomes["unchanged"] > 5 and sum(outcomes.values()) == 60, outcomes
