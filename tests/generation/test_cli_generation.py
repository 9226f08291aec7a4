"""`tinyloop MODEL speculate` and generate's --regex / --json-schema / --l-warmup-*: output, defaults, errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "TINYLOOP_LOG_LEVEL": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tinyloop.cli.main", *args], capture_output=True, timeout=120, env=env)


def test_speculate_defaults_in_help(tiny_files) -> None:
    out = run(str(tiny_files["f32"]), "speculate", "--help").stdout.decode()
    for flag, default in [
        ("--prompt", "'The meaning of life is'"), ("--draft-loops", "2"), ("--verify-loops", "8"),
        ("--draft-ahead", "4"), ("--max-tokens", "50"), ("--temperature", "0.0"), ("--top-k", "50"),
        ("--top-p", "0.9"),
    ]:  # fmt: skip
        assert re.search(re.escape(flag) + r"[^\n]*\n?[^\n]*default: " + re.escape(default), out), flag
    for flag in ("--cache-window", "--stats", "--seed", "--regex", "--json-schema"):
        assert flag in out


def test_speculate_matches_generate_and_prints_stats(tiny_files) -> None:
    path = str(tiny_files["f32"])
    spec = run(path, "speculate", "--prompt", "Hi", "--draft-loops", "1", "--verify-loops", "4", "--max-tokens", "12",
               "--stats")  # fmt: skip
    assert spec.returncode == 0, spec.stderr
    plain = run(path, "generate", "--prompt", "Hi", "--loops", "4", "--max-tokens", "12", "--temperature", "0")
    assert spec.stdout == plain.stdout and len(spec.stdout) == 2 + 12 + 1
    err = spec.stderr.decode()
    assert "acceptance" in err and "tokens per verify pass" in err and "speed-up" in err and "same tokens" in err


def test_generate_with_regex_json_schema_and_depth_schedule(tiny_files, tmp_path) -> None:
    path = str(tiny_files["f32"])
    res = run(path, "generate", "--prompt", "On ", "--regex", "[0-9]{4}-[0-9]{2}", "--max-tokens", "20")
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(rb"On [0-9]{4}-[0-9]{2}\n", res.stdout)
    # A finite language (an unbounded integer from random weights may outrun any token budget).
    schema = {"type": "object", "properties": {"n": {"type": "integer", "enum": [7, 42, 365]}}, "required": ["n"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    res = run(path, "generate", "--prompt", "J", "--json-schema", str(tmp_path / "s.json"), "--max-tokens", "60")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout[1:])["n"] in (7, 42, 365)
    res = run(path, "generate", "--prompt", "x", "--loops", "4", "--l-warmup-tokens", "3", "--l-warmup-L", "1",
              "--max-tokens", "6")  # fmt: skip
    assert res.returncode == 0 and len(res.stdout) == 1 + 6 + 1


@pytest.mark.parametrize(
    "verb, flags, needle",
    [
        ("speculate", ["--draft-loops", "8", "--verify-loops", "8"], "--draft-loops"),
        ("speculate", ["--draft-ahead", "0"], "--draft-ahead"),
        ("speculate", ["--top-p", "2"], "--top-p"),
        ("speculate", ["--regex", "(ab"], "position 0"),
        ("generate", ["--regex", "a{3,1}"], "position 2"),
        ("generate", ["--json-schema", "/no/such/file.json"], "--json-schema"),
        ("generate", ["--regex", "a", "--json-schema", "{}"], "not allowed with"),
    ],
)
def test_errors_are_one_line_with_status_2(tiny_files, verb, flags, needle) -> None:
    res = run(str(tiny_files["f32"]), verb, *flags)
    lines = res.stderr.decode().strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], lines


def test_speculate_stops_like_generate(tiny_files) -> None:
    path = str(tiny_files["f32"])
    common = ["--prompt", "Hi", "--max-tokens", "24"]
    full = run(path, "generate", *common, "--loops", "4", "--temperature", "0")
    stop = full.stdout[2:-1][10:12].decode("latin-1")
    plain = run(path, "generate", *common, "--loops", "4", "--temperature", "0", "--stop", stop, "--stop", "\x01")
    spec = run(path, "speculate", *common, "--draft-loops", "1", "--verify-loops", "4", "--stop", stop, "--stats")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and len(spec.stdout) < len(full.stdout)
    assert b"same tokens" in spec.stderr and b"stop stop_string" in spec.stderr


def test_speculate_with_depth_schedule_matches_generate(tiny_files) -> None:
    path = str(tiny_files["f32"])
    common = ["--prompt", "x", "--max-tokens", "16", "--l-warmup-tokens", "4", "--l-warmup-L", "1"]
    plain = run(path, "generate", *common, "--loops", "4", "--temperature", "0")
    spec = run(path, "speculate", *common, "--draft-loops", "2", "--verify-loops", "4")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--cache-window", "8"], "--cache-window 8 cannot be used with speculate"),
        (["--l-warmup-tokens", "2", "--l-warmup-L", "9"], "--l-warmup-L (9) must not exceed --verify-loops (8)"),
        (["--stop", ""], "--stop must not be empty"),
    ],
)
def test_speculate_refusals_are_one_line(tiny_files, flags, needle) -> None:
    res = run(str(tiny_files["f32"]), "speculate", *flags)
    lines = res.stderr.decode().strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], lines
