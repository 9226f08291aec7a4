"""`--dtype auto`: bfloat16 matmuls on a CPU only where it has native bfloat16 instructions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinyloop.cli import args as cli_args


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (frozenset({"avx2", "avx512f", "avx512_bf16"}), True),
        (frozenset({"avx2", "amx_bf16", "amx_tile"}), True),
        (frozenset({"avx2", "avx512f", "avx512bw"}), False),
        (frozenset({"avx2", "fma"}), False),
        (frozenset(), False),
    ],
)
def test_auto_takes_bfloat16_only_with_native_bfloat16(flags, expected) -> None:
    assert cli_args.auto_cpu_bfloat16(flags) is expected


@pytest.mark.parametrize(("flags", "expected"), [({"avx512_bf16"}, torch.bfloat16), ({"avx2"}, None)])
def test_auto_on_the_cpu_follows_the_capability_reader(monkeypatch, flags, expected) -> None:
    monkeypatch.setattr(cli_args, "cpu_flags", lambda: frozenset(flags))
    assert cli_args.torch_dtype("auto", "cpu") is expected


def test_auto_on_cuda_and_explicit_choices_ignore_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(cli_args, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert cli_args.torch_dtype("auto", "cuda") is None
    assert cli_args.torch_dtype("auto", "cuda:1") is None
    assert cli_args.torch_dtype("float32", "cpu") is torch.float32
    assert cli_args.torch_dtype("float16", "cpu") is torch.float16


def test_cpu_flags_reads_this_machine() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text(encoding="utf-8").splitlines() if cpuinfo.exists() else []
    first = next((line for line in lines if line.startswith("flags")), None)
    expected = frozenset() if first is None else frozenset(first.partition(":")[2].split())
    assert cli_args.cpu_flags() == expected


def test_speculate_takes_the_same_dtype_as_generate(tiny_files) -> None:
    # INT4 weights: whatever --dtype auto resolves to on this CPU, both commands take it and agree token for token.
    env = {**os.environ, "TINYLOOP_LOG_LEVEL": "0", "OMP_NUM_THREADS": "1"}
    common = ["--prompt", "def f(", "--max-tokens", "16", "--device", "cpu"]
    spec, plain = (
        subprocess.run(
            [sys.executable, "-m", "tinyloop.cli.main", str(tiny_files["int4"]), verb, *common, *extra],
            capture_output=True,
            timeout=120,
            env=env,
        )  # fmt: skip
        for verb, extra in (
            ("speculate", ["--draft-loops", "1", "--verify-loops", "4"]),
            ("generate", ["--loops", "4", "--temperature", "0"]),
        )  # fmt: skip
    )
    assert spec.returncode == 0 and plain.returncode == 0, (spec.stderr, plain.stderr)
    assert spec.stdout == plain.stdout and len(spec.stdout) == len("def f(") + 16 + 1
