"""A failed write leaves neither a partial file nor a temp file, and never replaces a good file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinyloop.config import ArchConfig
from tinyloop.format import read_header, write_model
from tinyloop.format import writer as writer_module


def test_failure_mid_write_leaves_nothing(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights) -> None:
    bad = dict(tiny_weights)
    bad["final_norm.weight"] = torch.full_like(bad["final_norm.weight"], float("nan"))
    with pytest.raises(ValueError, match="final_norm.weight"):
        write_model(tmp_path / "m.tinyloop", tiny_cfg, bad, bits=4, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_interrupt_keeps_the_old_file(
    tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.tinyloop"
    write_model(path, tiny_cfg, tiny_weights, bits=8, progress=False)
    before = path.read_bytes()
    calls = 0
    real = writer_module._as_bytes

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "_as_bytes", flaky)
    with pytest.raises(KeyboardInterrupt):
        write_model(path, tiny_cfg, tiny_weights, bits=4, progress=False)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.tinyloop"]


def test_overwrite_replaces_atomically(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights) -> None:
    path = tmp_path / "m.tinyloop"
    write_model(path, tiny_cfg, tiny_weights, bits=8, progress=False)
    header = write_model(path, tiny_cfg, tiny_weights, bits=4, progress=False)
    assert header.path == str(path)
    assert read_header(path).quantization.bits == 4
    assert [p.name for p in tmp_path.iterdir()] == ["m.tinyloop"]


def test_missing_directory_is_an_os_error(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights) -> None:
    with pytest.raises(OSError):
        write_model(tmp_path / "no" / "m.tinyloop", tiny_cfg, tiny_weights, progress=False)
