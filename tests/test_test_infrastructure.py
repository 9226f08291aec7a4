"""The suite's own machinery: shared data is found or its absence reported, marker lists name real tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shared_data import REPO, SHARED, shared_path
from suite_markers import INTERPRET_MODULES, SLOW_TESTS, TESTS


def test_shared_data_is_found_next_to_the_checkout() -> None:
    assert SHARED == REPO.parent / "shared"
    assert shared_path("vectors", "ouro-tiny").is_dir()


def test_missing_shared_data_fails_on_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="is missing .*CI is set, so this fails"):
        shared_path("vectors", root=tmp_path / "no-shared")


@pytest.mark.parametrize("value", ["", "0", "false"])
def test_missing_shared_data_skips_with_its_path_elsewhere(tmp_path: Path, monkeypatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match=f"shared data {tmp_path / 'no-shared'}/vectors is missing"):
        shared_path("vectors", root=tmp_path / "no-shared")


def test_marker_lists_name_existing_tests() -> None:
    for module in INTERPRET_MODULES:
        assert (TESTS / module).is_file(), module
    for entry in SLOW_TESTS:
        module, name = entry.split("::")
        assert (TESTS / module).is_file(), entry
        tree = ast.parse((TESTS / module).read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, entry
