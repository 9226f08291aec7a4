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


def test_sigterm_mid_write_removes_the_temporary_file(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from format_helpers import src_env

    script = f"""
import sys, time
from tinyloop.convert.random_model import random_weights
from tinyloop.format import writer
from tinyloop.presets import preset
cfg = preset("test-tiny")
weights = random_weights(cfg, seed=1)
real = writer._as_bytes
def slow(*args):
    print("writing", flush=True)
    time.sleep(60)
    return real(*args)
writer._as_bytes = slow
writer.write_model({str(tmp_path / "m.tinyloop")!r}, cfg, weights, progress=False)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=src_env())
    assert proc.stdout is not None and proc.stdout.readline() == b"writing\n"
    assert len(list(tmp_path.iterdir())) == 1  # the temporary file
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_files_are_removed_by_the_next_write(
    tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights
) -> None:
    import os

    dead = 2**22 + 12345  # above the default pid_max: no such process
    with pytest.raises(ProcessLookupError):
        os.kill(dead, 0)
    stale = tmp_path / f".m.tinyloop.{dead}.abc123.tmp"
    stale.write_bytes(b"x" * 100)
    other = tmp_path / f".other.tinyloop.{dead}.abc123.tmp"  # another target's: left alone
    other.write_bytes(b"x")
    write_model(tmp_path / "m.tinyloop", tiny_cfg, tiny_weights, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "m.tinyloop"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_output_mode_follows_the_umask(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights, umask: int) -> None:
    import os

    old = os.umask(umask)
    try:
        write_model(tmp_path / "m.tinyloop", tiny_cfg, tiny_weights, progress=False)
    finally:
        os.umask(old)
    assert (tmp_path / "m.tinyloop").stat().st_mode & 0o777 == 0o666 & ~umask


def test_missing_directory_is_named(tmp_path: Path, tiny_cfg: ArchConfig, tiny_weights) -> None:
    with pytest.raises(FileNotFoundError, match="no such directory"):
        write_model(tmp_path / "no" / "m.tinyloop", tiny_cfg, tiny_weights, progress=False)
