"""The corpus builder: filters, a hash-stable validation split, recorded hashes, exact reproducibility."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tinyloop.train.corpus import build_corpus, is_validation, join_documents, main, split_documents


def test_filters_keep_only_plain_sources(corpus_dir: Path) -> None:
    m = json.loads((corpus_dir / "manifest.json").read_text())
    kept = set(m["train_files"]) | set(m["val_files"])
    suites = {"test/test_a.py", "pkg/tests/test_b.py", "idlelib/idle_test/test_c.py", "lib2to3/tests/data/d.py"}
    assert len(kept) == 154 == m["files_kept"] and suites <= kept  # test suites are ordinary Python: kept
    assert all(p.startswith(("mod_", "pkg/mod_")) for p in kept - suites)
    skipped = m["files_skipped"]
    assert skipped["larger than 200000 bytes"] == 1
    assert skipped["not UTF-8"] == 1
    assert skipped["contains NUL"] == 1
    assert skipped["build-generated _sysconfigdata_"] == 1
    for d in ("site-packages", "config-*", "__pycache__"):
        assert skipped[f"directory {d}"] >= 1, d


def test_split_is_stable_and_hashes_are_recorded(corpus_dir: Path) -> None:
    m = json.loads((corpus_dir / "manifest.json").read_text())
    expected_val = sorted(p for p in m["train_files"] + m["val_files"] if is_validation(p))
    assert m["val_files"] == expected_val and expected_val  # 150 paths: some land in validation
    assert m["train_files"] == sorted(m["train_files"])
    for name in ("train", "val"):
        blob = (corpus_dir / f"{name}.bin").read_bytes()
        info = m["splits"][name]
        assert info["bytes"] == len(blob)
        assert info["sha256"] == hashlib.sha256(blob).hexdigest()
        assert len(split_documents(blob)) == info["files"]


def test_documents_round_trip_and_match_sources(corpus_dir: Path, fake_stdlib: Path) -> None:
    m = json.loads((corpus_dir / "manifest.json").read_text())
    docs = split_documents((corpus_dir / "val.bin").read_bytes())
    assert docs == [(fake_stdlib / p).read_bytes() for p in m["val_files"]]
    assert split_documents(join_documents([b"a", b"", b"bc"])) == [b"a", b"", b"bc"]


def test_rebuild_is_byte_identical(fake_stdlib: Path, corpus_dir: Path, tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--root", str(fake_stdlib)]) == 0
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / name).read_bytes() == (corpus_dir / name).read_bytes()
    again = build_corpus(fake_stdlib, tmp_path / "again")
    assert again["splits"] == json.loads((corpus_dir / "manifest.json").read_text())["splits"]
