"""The `tinyloop` command: generation streams to stdout, timing to stderr, one-line errors with status 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    full_env = {**os.environ, "TINYLOOP_LOG_LEVEL": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tinyloop.cli.main", *args], capture_output=True, timeout=120, env=full_env
    )


def test_generate_streams_prompt_and_continuation(tiny_files) -> None:
    res = run(str(tiny_files["int4"]), "generate", "--prompt", "hi", "--max-tokens", "9", "--seed", "3")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(b"hi") and len(res.stdout) == 2 + 9 + 1
    err = res.stderr.decode()
    assert "prefill:" in err and "tokens/s" in err
    assert "test-tiny-int4.tinyloop: format 1.1, 4-bit" in err  # level-1 header


def test_generate_greedy_is_repeatable_and_log_level_zero_is_quiet(tiny_files) -> None:
    args = (str(tiny_files["f16"]), "generate", "--prompt", "abc", "--max-tokens", "12", "--temperature", "0")
    a = run(*args, env={"TINYLOOP_LOG_LEVEL": "0"})
    b = run(*args, env={"TINYLOOP_LOG_LEVEL": "7"})  # out of range falls back to 1
    assert a.stdout == b.stdout
    assert "[tinyloop]" not in a.stderr.decode()
    assert "[tinyloop]" in b.stderr.decode()


def test_generate_in_bfloat16_on_cpu_keeps_the_greedy_text() -> None:
    args = ("tiny", "generate", "--prompt", "def fibonacci(n):\n", "--max-tokens", "24", "--temperature", "0")
    exact = run(*args, "--device", "cpu")
    fast = run(*args, "--device", "cpu", "--dtype", "bfloat16")
    assert exact.returncode == 0 and fast.returncode == 0, fast.stderr
    assert "INT4 matmuls in bfloat16" in fast.stderr.decode()
    assert fast.stdout == exact.stdout


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--loops", "0"], "--loops"),
        (["--max-tokens", "-3"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--top-k", "x"], "--top-k"),
        (["--top-p", "0"], "--top-p"),
        (["--l-warmup-tokens", "-1"], "--l-warmup-tokens"),
        (["--l-warmup-tokens", "2", "--l-warmup-L", "9"], "--l-warmup-L"),
        (["--l-warmup-L", "0"], "--l-warmup-L"),
        (["--dtype", "half"], "--dtype"),
        (["--no-such-flag"], "unrecognized"),
    ],
)
def test_bad_generate_arguments_exit_2_with_one_line(tiny_files, flags, needle) -> None:
    res = run(str(tiny_files["int4"]), "generate", *flags)
    assert res.returncode == 2
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_unknown_model_and_command() -> None:
    res = run("definitely-not-a-model", "generate")
    assert res.returncode == 2 and "built-in models" in res.stderr.decode()
    res = run("definitely-not-a-model")
    assert res.returncode == 2


def test_unknown_command(tiny_files) -> None:
    res = run(str(tiny_files["int4"]), "frobnicate")
    assert res.returncode == 2 and "unknown command" in res.stderr.decode()


def test_lens_prints_a_row_per_position_and_draws_a_heatmap(tiny_files, tmp_path) -> None:
    png = tmp_path / "lens.png"
    res = run(str(tiny_files["f32"]), "lens", "--prompt", "abc", "--loops", "3", "--plot", str(png))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.decode().splitlines()
    assert lines[0].split()[-3:] == ["L1", "L2", "L3"] and len(lines) == 1 + 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
