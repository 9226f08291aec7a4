"""A bad prefix pool file is one PrefixPoolFormatError naming the entry and field: malformed metadata, flipped
bytes, K/V of the wrong dtype or shape, slot counts that disagree with `loops`, forged identities."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from file_fuzz import fuzz_pool_files
from tinyloop.cache import pool_file
from tinyloop.cache.pool import PrefixPool
from tinyloop.errors import PrefixPoolFormatError, TinyLoopFormatError

SYSTEM = [(7 * i + 3) % 256 for i in range(40)]


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory) -> dict[str, Path]:
    """A saved pool of two entries per KV mode that stores K/V."""
    out = {}
    root = tmp_path_factory.mktemp("pools")
    for mode in ("16bit", "int8", "hidden", "window"):
        m = models[mode]
        pool = PrefixPool()
        for n, loops in ((12, 2), (20, 3)):
            m.register_prefix(pool, m.build_prefix_cache(SYSTEM[:n], loops=loops))
        out[mode] = root / f"{mode}.safetensors"
        pool.save(out[mode])
    return out


def rewrite(
    src: Path,
    dst: Path,
    meta_fn: Callable[[dict[str, Any]], None] | None = None,
    tensor_fn: Callable[[dict[str, torch.Tensor]], None] | None = None,
    fix_crc: bool = True,
    raw_meta: str | None = None,
) -> Path:
    with safe_open(str(src), framework="pt") as f:
        meta = json.loads(f.metadata()["tinyloop"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if tensor_fn is not None:
        tensor_fn(tensors)
    if fix_crc:
        for i, entry in enumerate(meta["entries"]):
            entry["crc32"] = {
                n: pool_file._crc32(tensors[f"{i}/{n}"].contiguous()) for n in entry["names"] if f"{i}/{n}" in tensors
            }
    if meta_fn is not None:
        meta_fn(meta)
    save_file(tensors, str(dst), metadata={"tinyloop": raw_meta if raw_meta is not None else json.dumps(meta)})
    return dst


def refused(path: Path, model, *fragments: str) -> PrefixPoolFormatError:
    with pytest.raises(PrefixPoolFormatError) as info:
        PrefixPool.load(path, model)
    assert isinstance(info.value, TinyLoopFormatError) and isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return info.value


def test_round_trip_keeps_checksums_and_outputs(models, saved) -> None:
    for mode, path in saved.items():
        pool = PrefixPool.load(path, models[mode])
        assert [len(c.tokens) for c in pool.entries()] == [12, 20]
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["tinyloop"])
        assert meta["version"] == 2 and all(set(e["crc32"]) == set(e["names"]) for e in meta["entries"])


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def go(meta: dict[str, Any]) -> None:
        node = meta
        for step in path[:-1]:
            node = node[step]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return go


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (_set(["entries"], KeyError), ["metadata 'entries'"]),
        (_set(["max_bytes"], 2**70), ["metadata 'max_bytes'"]),
        (_set(["max_entries"], "5"), ["metadata 'max_entries'"]),
        (_set(["entries", 1, "loops"], "3"), ["entry 1 'loops'"]),
        (_set(["entries", 1, "loops"], 10**6), ["entry 1 'loops'"]),
        (_set(["entries", 0, "key"], None), ["entry 0 'key'"]),
        (_set(["entries", 0, "key"], "0" * 64), ["entry 0 'key'", "content key"]),
        (_set(["entries", 0, "names"], KeyError), ["entry 0 'names'"]),
        (_set(["entries", 0, "crc32"], KeyError), ["entry 0 'crc32'"]),
        (_set(["entries", 0], [1, 2]), ["entry 0"]),
        (_set(["model_key"], None), ["metadata 'model_key'"]),
        (_set(["model_key"], "another-model@0123/16bit/float32"), ["metadata 'model_key'", "rebuild"]),
        (_set(["version"], 3), ["metadata 'version'"]),
        (_set(["format"], "gguf"), ["metadata 'format'"]),
    ],
)
def test_malformed_metadata(models, saved, tmp_path: Path, edit, fragments: list[str]) -> None:
    path = rewrite(saved["int8"], tmp_path / "bad.safetensors", edit)
    refused(path, models["int8"], *fragments)


def test_flipped_byte_in_tensor_data_is_found(models, saved, tmp_path: Path) -> None:
    def flip(tensors: dict[str, torch.Tensor]) -> None:
        tensors["1/kv.k"].view(-1)[5] += 1

    path = rewrite(saved["int8"], tmp_path / "flip.safetensors", tensor_fn=flip, fix_crc=False)
    refused(path, models["int8"], "entry 1 tensor 'kv.k'", "CRC32", "corrupted")


@pytest.mark.parametrize(
    ("mode", "tensor_fn", "fragments"),
    [
        ("16bit", lambda t: t.update({"0/kv.k": t["0/kv.k"].to(torch.int8)}), ["entry 0 tensor 'kv.k' dtype"]),
        ("16bit", lambda t: t.update({"0/kv.v": t["0/kv.v"].bool()}), ["entry 0 tensor 'kv.v' dtype"]),
        ("16bit", lambda t: t.update({"0/kv.k": t["0/kv.k"][:1].contiguous()}), ["entry 0 tensor 'kv.k' shape"]),
        ("int8", lambda t: t.update({"1/kv.k_scale": t["1/kv.k_scale"][..., :1].contiguous()}), ["'kv.k_scale' shape"]),
        ("16bit", lambda t: t.update({"0/last_logits": torch.zeros(300)}), ["entry 0 tensor 'last_logits' shape"]),
        ("16bit", lambda t: t["0/kv.v"].view(-1).__setitem__(0, float("nan")), ["entry 0 tensor 'kv.v'", "finite"]),
        ("hidden", lambda t: t.update({"0/kv.h": t["0/kv.h"].double()}), ["entry 0 tensor 'kv.h' dtype"]),
        ("window", lambda t: t.pop("1/kv.ring_pos"), ["tensors"]),
        ("16bit", lambda t: t.update({"0/tokens": t["0/tokens"][None]}), ["entry 0 tensor 'tokens'"]),
        ("16bit", lambda t: t.update({"0/tokens": t["0/tokens"] + 1000}), ["entry 0"]),
    ],
)
def test_tensors_checked_against_the_model(models, saved, tmp_path: Path, mode, tensor_fn, fragments) -> None:
    path = rewrite(saved[mode], tmp_path / "bad.safetensors", tensor_fn=tensor_fn)
    refused(path, models[mode], *fragments)


def test_loops_inconsistent_with_the_slot_count(models, saved, tmp_path: Path) -> None:
    path = rewrite(saved["16bit"], tmp_path / "loops.safetensors", _set(["entries", 0, "loops"], 3))
    refused(path, models["16bit"], "entry 0 tensor 'kv.k' shape")


def test_a_file_of_another_kv_mode_is_refused(models, saved) -> None:
    refused(saved["int8"], models["16bit"], "'model_key'")


def test_duplicate_keys_and_junk(models, saved, tmp_path: Path) -> None:
    with safe_open(str(saved["16bit"]), framework="pt") as f:
        raw = f.metadata()["tinyloop"]
    dup = raw[:-1] + ', "max_entries": 7}'
    refused(rewrite(saved["16bit"], tmp_path / "dup.safetensors", raw_meta=dup), models["16bit"], "duplicate key")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a pool")
    refused(junk, models["16bit"], "file")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(saved["16bit"].read_bytes()[:-100])
    refused(cut, models["16bit"], "file")


def test_version_1_files_without_checksums_still_load(models, saved, tmp_path: Path) -> None:
    def v1(meta: dict[str, Any]) -> None:
        meta["version"] = 1
        for entry in meta["entries"]:
            del entry["crc32"]

    pool = PrefixPool.load(rewrite(saved["16bit"], tmp_path / "v1.safetensors", v1), models["16bit"])
    assert len(pool) == 2


def test_saving_into_a_missing_directory_is_named(models, tmp_path: Path) -> None:
    pool = PrefixPool()
    pool.register(models["16bit"].build_prefix_cache(SYSTEM[:5], loops=1))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope'}: no such directory"):
        pool.save(tmp_path / "nope" / "pool.safetensors")


def test_seeded_pool_file_mutations(models, tmp_path: Path) -> None:
    """Truncations, bit flips, metadata edits, tensors of the wrong dtype, shape or values with recomputed
    checksums, and harmless rewrites: each is refused with PrefixPoolFormatError or loads the same entries."""
    outcomes = fuzz_pool_files(models["int8"], tmp_path, 200, seed=99)
    assert outcomes["unchanged"] > 5 and outcomes["refused"] > 100 and sum(outcomes.values()) == 200, outcomes
