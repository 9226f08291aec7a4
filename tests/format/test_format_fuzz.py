"""Mutated files either load with unchanged output or raise TinyLoopFormatError: never another error or a hang."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from file_fuzz import deadline, fuzz_model_files
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format import load_weights, read_header

CASES = 300
CASE_SECONDS = 5.0


def test_seeded_model_file_mutations(format_files: dict[str, Path], tmp_path: Path) -> None:
    """Truncations, bit flips, trailing bytes, header edits (inside the config, quantization and checksums
    documents too), forged out-of-range config values and NaNs with recomputed checksums, and harmless
    rewrites: each is refused with TinyLoopFormatError or loads and computes the same logits."""
    outcomes = fuzz_model_files(format_files["4"], tmp_path, CASES, seed=1234)
    # Both outcomes happen, so the mutations are neither all fatal nor all harmless.
    assert outcomes["unchanged"] > 10 and outcomes["refused"] > 100 and sum(outcomes.values()) == CASES, outcomes


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


def test_one_bit_in_tensor_data_is_found_by_verify_and_load(format_files: dict[str, Path], tmp_path: Path) -> None:
    from tinyloop.format import verify_checksums

    header = read_header(format_files["4"])
    entry = header.tensors["body.0.attn.qkv.weight.q4"]
    raw = bytearray(format_files["4"].read_bytes())
    raw[header.data_start + entry.start + 17] ^= 0x10
    path = tmp_path / "flipped.tinyloop"
    path.write_bytes(raw)
    assert verify_checksums(format_files["4"]) == []
    assert verify_checksums(path) == ["body.0.attn.qkv.weight.q4"]
    with pytest.raises(TinyLoopFormatError, match="'body.0.attn.qkv.weight.q4'.*corrupted"):
        load_weights(path)  # loading checks every tensor's CRC32 too
