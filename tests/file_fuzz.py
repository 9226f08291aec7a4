"""Seeded fuzzing of the files TinyLoop reads: `.tinyloop` models, prefix pool files, Hugging Face folders.

Every case mutates a good file (or folder) and opens it the way a user would. The only accepted outcomes:

- "refused": the documented exception (TinyLoopFormatError; PrefixPoolFormatError for pools), and nothing else;
- "unchanged": it loads, and what it computes is bit-identical to the unmutated file's;
- for HF folders only, "different": a config.json value was changed to another valid value, so the folder
  is another valid checkpoint; it converts, and the converted file loads and gives finite logits.

Any other exception, a hang (each case has a deadline) or a changed result raises FuzzFailure naming the case.
Used by tests/format/test_format_fuzz.py (CI-sized) and bench/fuzz_files.py (the documented larger run).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tinyloop.errors import PrefixPoolFormatError, TinyLoopFormatError

CASE_SECONDS = 20.0
PROMPT = [3, 141, 59, 26, 5, 35, 89, 79]
_JSON_STRINGS = ("config", "quantization", "checksums")


class FuzzFailure(AssertionError):
    pass


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise CaseTimeout(f"case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_case(kind: str, case: int, how: str, fn: Callable[[], str], refusal: type[Exception]) -> str:
    """fn returns the outcome of a case that opened; the documented refusal is the only accepted exception."""
    try:
        with deadline(CASE_SECONDS):
            return fn()
    except refusal:
        return "refused"
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise FuzzFailure(f"{kind} case {case} ({how}): {type(exc).__name__}: {exc}") from exc


# ---- JSON surgery ---------------------------------------------------------------------------------
def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _new_value(rng: random.Random, old: Any) -> Any:
    if isinstance(old, bool) or not isinstance(old, (int, float)):
        return rng.choice([None, "", "F16", "U8", "int4", [], {}, 0, -1, True, 1.5, "x" * 10, [1, 2], "../x"])
    return rng.choice(
        [old + 1, old - 1, -old, 0, -1, 2 * old, old // 2, 2**31, 2**63, 2**64 + 7, 10**30, 0.5, None, 1e300]
    )


def mutate_json(rng: random.Random, doc: Any, edits: int) -> list[str]:
    """Delete, duplicate under a new key, or replace random nodes; returns what was done."""
    done = []
    for _ in range(edits):
        path = rng.choice(list(_paths(doc)))
        if not path:
            continue
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        key = path[-1]
        action = rng.random()
        if action < 0.25 and isinstance(parent, dict):
            del parent[key]
            done.append(f"del {path}")
        elif action < 0.35 and isinstance(parent, dict):
            parent[f"{key}_copy"] = parent[key]
            done.append(f"copy {path}")
        else:
            parent[key] = _new_value(rng, parent[key])
            done.append(f"set {path}={parent[key]!r}"[:120])
    return done


def _flip_bits(rng: random.Random, raw: bytes, head: int) -> bytes:
    out = bytearray(raw)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(head) if rng.random() < 0.5 else rng.randrange(len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


# ---- .tinyloop model files ------------------------------------------------------------------------
def model_output(path: Path) -> torch.Tensor:
    """Logits of a fixed prompt at 2 loops (what a run computes first)."""
    from tinyloop.runtime.loader import load_engine

    _, engine = load_engine(path, torch.device("cpu"), max_positions=len(PROMPT))
    with torch.inference_mode():
        return engine.step(torch.tensor([PROMPT]), None, 2).logits.clone()


def _split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(doc: dict[str, Any], data: bytes, align: int = 8, indent: int | None = None) -> bytes:
    header = json.dumps(doc, indent=indent).encode()
    header += b" " * (-(8 + len(header)) % align)
    return len(header).to_bytes(8, "little") + header + data


def mutate_model(rng: random.Random, raw: bytes) -> tuple[bytes, str]:
    from tinyloop.format.header import config_crc32

    choice = rng.random()
    if choice < 0.15:
        cut = rng.randrange(len(raw))
        return raw[:cut], f"truncate at {cut}"
    if choice < 0.35:
        return _flip_bits(rng, raw, 72), "bit flips"
    if choice < 0.40:
        return raw + bytes(rng.randrange(1, 100)), "trailing bytes"
    doc, data = _split(raw)
    meta = doc["__metadata__"]
    if choice < 0.50:  # the same header, written differently: must load unchanged
        items = list(doc.items())
        rng.shuffle(items)
        doc = dict(items)
        doc["__metadata__"]["x-note"] = "a tool's own key"
        return _join(doc, data, rng.choice([8, 64]), rng.choice([None, 1])), "reordered, re-indented, x- key"
    if choice < 0.62:  # a config value out of range, its checksum recomputed (a forged, consistent file)
        cfg = json.loads(meta["config"])
        field, value = rng.choice(_OUT_OF_RANGE)
        cfg[field] = value
        meta["config"] = json.dumps(cfg)
        meta["config_crc32"] = config_crc32(meta["config"])
        return _join(doc, data), f"config {field}={value!r} (checksum recomputed)"
    if choice < 0.70:  # a non-finite value in a float tensor, its checksum recomputed
        floats = [n for n, e in doc.items() if n != "__metadata__" and e["dtype"] in ("F32", "F16")]
        name = rng.choice(floats)
        entry = doc[name]
        size = 4 if entry["dtype"] == "F32" else 2
        count = (entry["data_offsets"][1] - entry["data_offsets"][0]) // size
        at = entry["data_offsets"][0] + size * rng.randrange(count)
        bad = torch.tensor([rng.choice([float("nan"), float("inf"), -float("inf")])])
        bad = bad.to(torch.float32 if size == 4 else torch.float16).numpy().tobytes()
        data = data[:at] + bad + data[at + size :]
        crcs = json.loads(meta["checksums"])
        import zlib

        begin, end = entry["data_offsets"]
        crcs[name] = f"{zlib.crc32(data[begin:end]) & 0xFFFFFFFF:08x}"
        meta["checksums"] = json.dumps(crcs)
        return _join(doc, data), f"non-finite value in {name} (checksum recomputed)"
    for key in _JSON_STRINGS:  # decode the nested JSON strings so edits reach inside them
        meta[key] = json.loads(meta[key])
    done = mutate_json(rng, doc, rng.randint(1, 3))
    meta = doc.get("__metadata__")
    if isinstance(meta, dict):
        for key in _JSON_STRINGS:
            if key in meta and rng.random() > 0.1:
                meta[key] = json.dumps(meta[key])
    return _join(doc, data, rng.choice([1, 8, 64])), "header: " + "; ".join(done)


_OUT_OF_RANGE = [
    ("embed_scale", 1e300), ("embed_scale", 0), ("logit_scale", 0.0), ("logit_scale", -2.0), ("norm_eps", 1e30),
    ("norm_eps", 0.0), ("rope_base", 1.5), ("default_loops", 16777216), ("max_position", 2**24),
    ("state_init_std", -1.0), ("n_body", 10**6), ("head_dim", 3), ("vocab_size", 0), ("d_model", "64"),
]  # fmt: skip


def fuzz_model_files(source: Path, workdir: Path, cases: int, seed: int) -> Counter[str]:
    """Mutate `source` (a small `.tinyloop` file) `cases` times; count refused / unchanged."""
    from tinyloop.cli.inspect_cmd import run_inspect
    from tinyloop.format import read_header
    from tinyloop.format.checksums import corrupted_tensors

    raw = source.read_bytes()
    baseline = model_output(source)
    rng = random.Random(seed)
    path = workdir / "fuzz.tinyloop"
    outcomes: Counter[str] = Counter()
    for case in range(cases):
        mutated, how = mutate_model(rng, raw)
        path.write_bytes(mutated)

        def attempt() -> str:
            header = read_header(path)
            if not torch.equal(model_output(path), baseline):
                raise FuzzFailure("loaded, but the output changed")
            assert corrupted_tensors(header) == []
            with contextlib.redirect_stdout(io.StringIO()):
                assert run_inspect(str(path), ["--json"]) == 0
            return "unchanged"

        outcomes[run_case("model file", case, how, attempt, TinyLoopFormatError)] += 1
    return outcomes


# ---- prefix pool files ----------------------------------------------------------------------------
def _pool_parts(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["tinyloop"]), {k: f.get_tensor(k) for k in f.keys()}


def _save_pool_parts(path: Path, meta: Any, tensors: dict[str, torch.Tensor], fix_crc: bool) -> None:
    from tinyloop.cache.pool_file import _crc32

    if fix_crc and isinstance(meta, dict) and isinstance(meta.get("entries"), list):
        for i, entry in enumerate(meta["entries"]):
            if isinstance(entry, dict) and isinstance(entry.get("names"), list):
                names = [n for n in entry["names"] if isinstance(n, str) and f"{i}/{n}" in tensors]
                entry["crc32"] = {n: _crc32(tensors[f"{i}/{n}"].contiguous()) for n in names}
    save_file(tensors, str(path), metadata={"tinyloop": json.dumps(meta)})


def mutate_pool(rng: random.Random, raw: bytes, source: Path, path: Path) -> str:
    choice = rng.random()
    if choice < 0.15:
        cut = rng.randrange(len(raw))
        path.write_bytes(raw[:cut])
        return f"truncate at {cut}"
    if choice < 0.40:
        path.write_bytes(_flip_bits(rng, raw, 200))
        return "bit flips"
    if choice < 0.45:
        path.write_bytes(raw + bytes(rng.randrange(1, 100)))
        return "trailing bytes"
    meta, tensors = _pool_parts(source)
    if choice < 0.55:  # the same pool, its metadata written with another key order: must load unchanged
        items = list(meta.items())
        rng.shuffle(items)
        _save_pool_parts(path, dict(items), tensors, fix_crc=False)
        return "metadata reordered"
    if choice < 0.75:  # a tensor of the wrong kind, checksums recomputed (a forged, consistent file)
        name = rng.choice(sorted(tensors))
        t = tensors[name]
        edit = rng.choice(["int8", "bool", "float64", "slice", "nan", "longer", "scalar", "tokens"])
        if edit == "int8" or edit == "bool":
            tensors[name] = t.to(torch.int8 if edit == "int8" else torch.bool)
        elif edit == "float64":
            tensors[name] = t.double()
        elif edit == "slice" and t.dim() and t.shape[0] > 1:
            tensors[name] = t[: t.shape[0] // 2].contiguous()
        elif edit == "nan" and t.is_floating_point():
            t = t.clone()
            t.view(-1)[rng.randrange(t.numel())] = float("nan")
            tensors[name] = t
        elif edit == "longer":
            tensors[name] = torch.cat([t.reshape(-1), t.reshape(-1)[:1]])
        elif edit == "scalar":
            tensors[name] = t.reshape(-1)[:1].reshape(())
        else:
            tensors[name] = torch.full_like(t, 10**6) if t.dtype == torch.int32 else t.unsqueeze(0)
        _save_pool_parts(path, meta, tensors, fix_crc=True)
        return f"tensor {name}: {edit} (checksums recomputed)"
    done = mutate_json(rng, meta, rng.randint(1, 3))
    _save_pool_parts(path, meta, tensors, fix_crc=rng.random() < 0.5)
    return "metadata: " + "; ".join(done)


def _entries(pool: Any) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
    return [(item.key, int(item.loops), item.export_tensors()) for item in pool.entries()]


def _same_entries(a: list[Any], b: list[Any]) -> bool:
    if [(k, n, sorted(t)) for k, n, t in a] != [(k, n, sorted(t)) for k, n, t in b]:
        return False
    return all(torch.equal(x[name], y[name]) for (_, _, x), (_, _, y) in zip(a, b, strict=True) for name in x)


def fuzz_pool_files(model: Any, workdir: Path, cases: int, seed: int) -> Counter[str]:
    """Mutate a saved two-entry pool of `model` `cases` times; count refused / unchanged."""
    from tinyloop.cache.pool import PrefixPool

    pool = PrefixPool()
    for prefix, loops in ((PROMPT + [1], 1), (PROMPT + [2, 7, 1, 8, 2, 8], 2)):
        model.register_prefix(pool, model.build_prefix_cache(prefix, loops=loops))
    source = workdir / "pool.safetensors"
    pool.save(source)
    raw = source.read_bytes()
    baseline = _entries(PrefixPool.load(source, model))
    rng = random.Random(seed)
    path = workdir / "fuzz.safetensors"
    outcomes: Counter[str] = Counter()
    for case in range(cases):
        how = mutate_pool(rng, raw, source, path)

        def attempt() -> str:
            loaded = PrefixPool.load(path, model)
            loaded.check_integrity()
            if not _same_entries(_entries(loaded), baseline):
                raise FuzzFailure("loaded, but the entries changed")
            return "unchanged"

        outcomes[run_case("pool file", case, how, attempt, PrefixPoolFormatError)] += 1
    return outcomes


# ---- Hugging Face folders -------------------------------------------------------------------------
def _shard_parts(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_shard(path: Path, doc: Any, data: bytes) -> None:
    header = json.dumps(doc).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def shard_folder(folder: Path) -> None:
    """Split model.safetensors into two shards and an index, as save_pretrained does for big models."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def mutate_hf(rng: random.Random, folder: Path) -> tuple[str, bool]:
    """Mutate a folder in place; returns what was done and whether it may legitimately make another model."""
    shards = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    choice = rng.random()
    if choice < 0.30:
        cfg = json.loads((folder / "config.json").read_text())
        done = mutate_json(rng, cfg, rng.randint(1, 2))
        (folder / "config.json").write_text(json.dumps(cfg))
        return "config.json: " + "; ".join(done), True
    shard = rng.choice(shards)
    if choice < 0.60:
        doc, data = _shard_parts(shard)
        done = mutate_json(rng, doc, rng.randint(1, 2))
        _write_shard(shard, doc, data)
        return f"{shard.name} header: " + "; ".join(done), False
    if choice < 0.70 and index.exists():
        idx = json.loads(index.read_text())
        key = rng.choice(sorted(idx["weight_map"]))
        idx["weight_map"][key] = rng.choice(
            ["../" + shard.name, str(shard.resolve()), "missing.safetensors", "", 5, "./" + shard.name, None]
        )
        index.write_text(json.dumps(idx))
        return f"index: {key} -> {idx['weight_map'][key]!r}", False
    raw = shard.read_bytes()
    if choice < 0.80:
        cut = rng.randrange(len(raw))
        shard.write_bytes(raw[:cut])
        return f"{shard.name} truncated at {cut}", False
    n = int.from_bytes(raw[:8], "little")
    shard.write_bytes(_flip_bits(rng, raw[: 8 + n], 8 + n) + raw[8 + n :])  # header bytes only
    return f"{shard.name} header bit flips", False


def fuzz_hf_folders(source: Path, workdir: Path, cases: int, seed: int) -> Counter[str]:
    """Mutate copies of an HF folder (half of them sharded) and convert; count refused / unchanged / different."""
    from tinyloop.convert.from_hf import convert_hf
    from tinyloop.format import load_weights

    baseline = convert_hf(source, workdir / "base.tinyloop", progress=False).checksums
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    for case in range(cases):
        folder = workdir / "hf"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(source, folder)
        if rng.random() < 0.5:
            shard_folder(folder)
        how, may_differ = mutate_hf(rng, folder)
        out = workdir / "out.tinyloop"

        def attempt(folder: Path = folder, out: Path = out, may_differ: bool = may_differ) -> str:
            header = convert_hf(folder, out, progress=False)
            if header.checksums == baseline:
                return "unchanged"
            if not may_differ:
                raise FuzzFailure("converted into another model, though only the weights' files were damaged")
            load_weights(out)
            logits = model_output(out)
            if not bool(torch.isfinite(logits).all()):
                raise FuzzFailure("converted into a model whose logits are not finite")
            return "different"

        with contextlib.redirect_stderr(io.StringIO()):
            outcomes[run_case("HF folder", case, how, attempt, TinyLoopFormatError)] += 1
    return outcomes
