"""Mutated files either load completely or raise TinyLoopFormatError: never another error, never a hang."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyloop.cli.inspect_cmd import run_inspect
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format import load_weights, read_header
from tinyloop.format.checksums import corrupted_tensors
from tinyloop.quant import Int4Weight, Int8Weight

CASES = 300
CASE_SECONDS = 5.0
_JSON_STRINGS = ("config", "quantization", "checksums")


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


def exercise(path: Path) -> bool:
    """True when the file loads completely; False when it is refused with TinyLoopFormatError."""
    try:
        header = read_header(path)
        _, weights = load_weights(path, header=header)
    except TinyLoopFormatError:
        return False
    for w in weights.values():
        dense = w.dequantize() if isinstance(w, (Int8Weight, Int4Weight)) else w
        assert dense.shape == dense.shape  # touching the data must not fault
        float(dense.float().sum())
    corrupted_tensors(header)
    assert run_inspect(str(path), ["--json"]) == 0
    return True


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
        return rng.choice([None, "", "F16", "U8", "int4", [], {}, 0, -1, True, 1.5, "x" * 10, [1, 2]])
    return rng.choice([old + 1, old - 1, -old, 0, -1, 2 * old, old // 2, 2**31, 2**63, 2**64 + 7, 10**30, 0.5, None])


def mutate_header(rng: random.Random, raw: bytes) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    meta = doc["__metadata__"]
    # Decode the nested JSON strings so edits can reach inside them, then re-encode.
    for key in _JSON_STRINGS:
        meta[key] = json.loads(meta[key])
    for _ in range(rng.randint(1, 3)):
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
        elif action < 0.35 and isinstance(parent, dict):
            parent[f"{key}_copy"] = parent[key]
        else:
            parent[key] = _new_value(rng, parent[key])
    meta = doc.get("__metadata__")
    if isinstance(meta, dict):
        for key in _JSON_STRINGS:
            if key in meta and not (rng.random() < 0.1):
                meta[key] = json.dumps(meta[key])
    header = json.dumps(doc).encode()
    header += b" " * (-(8 + len(header)) % rng.choice([1, 8, 64]))
    return len(header).to_bytes(8, "little") + header + data


def mutate(rng: random.Random, raw: bytes) -> bytes:
    choice = rng.random()
    if choice < 0.3:
        return raw[: rng.randrange(len(raw))]
    if choice < 0.6:
        out = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            # Half of the flips land in the first 8 + 64 bytes, where the length and JSON start.
            i = rng.randrange(72) if rng.random() < 0.5 else rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        return bytes(out)
    if choice < 0.65:
        return raw + bytes(rng.randrange(1, 100))
    return mutate_header(rng, raw)


def test_seeded_mutations(format_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = format_files["4"].read_bytes()
    rng = random.Random(1234)
    path = tmp_path / "fuzz.tinyloop"
    outcomes = {True: 0, False: 0}
    for case in range(CASES):
        path.write_bytes(mutate(rng, raw))
        try:
            with deadline(CASE_SECONDS):
                outcomes[exercise(path)] += 1
        except Exception as exc:
            raise AssertionError(f"case {case}: {type(exc).__name__}: {exc}") from exc
        capsys.readouterr()
    # Both outcomes happen, so the mutations are neither all fatal nor all harmless.
    assert outcomes[True] > 10 and outcomes[False] > 100, outcomes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.binary(max_size=300), declared=st.integers(min_value=0, max_value=2**64 - 1) | st.none())
def test_arbitrary_bytes_are_refused(tmp_path: Path, header: bytes, declared: int | None) -> None:
    path = tmp_path / "junk.tinyloop"
    n = len(header) if declared is None else declared
    path.write_bytes(struct.pack("<Q", n) + header)
    with deadline(CASE_SECONDS), pytest.raises(TinyLoopFormatError):
        read_header(path)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(st.text(max_size=12), json_values, max_size=5), meta=json_values)
def test_arbitrary_json_headers_are_refused(tmp_path: Path, doc: dict[str, Any], meta: Any) -> None:
    path = tmp_path / "junk.tinyloop"
    doc["__metadata__"] = meta
    header = json.dumps(doc).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with deadline(CASE_SECONDS), pytest.raises(TinyLoopFormatError):
        read_header(path)


def test_one_bit_in_tensor_data_is_found_by_verify(format_files: dict[str, Path], tmp_path: Path) -> None:
    from tinyloop.format import verify_checksums

    header = read_header(format_files["4"])
    entry = header.tensors["body.0.attn.qkv.weight.q4"]
    raw = bytearray(format_files["4"].read_bytes())
    raw[header.data_start + entry.start + 17] ^= 0x10
    path = tmp_path / "flipped.tinyloop"
    path.write_bytes(raw)
    assert verify_checksums(format_files["4"]) == []
    assert verify_checksums(path) == ["body.0.attn.qkv.weight.q4"]
    _, weights = load_weights(path)  # loading never hashes, so the flip goes unnoticed here
    assert isinstance(weights["embed.weight"], Int4Weight)
    assert torch.is_tensor(weights["final_norm.weight"])
