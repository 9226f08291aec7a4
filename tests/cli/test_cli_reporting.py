"""What the CLI reports besides its output: the switches benchmark applies, TINYLOOP_LOG_LEVEL=2's load,
allocation and decode-path lines on the CPU, and no shutdown noise from Triton's bindings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tinyloop.cli.main import main
from tinyloop.layout import model_specs
from tinyloop.presets import preset

SMALL = ["--seq-len", "8", "--repeat", "1", "--loops", "2", "--device", "cpu"]


def test_benchmark_lists_the_switches_it_ignores_apart(tiny_files, capsys, monkeypatch) -> None:
    monkeypatch.delenv("TINYLOOP_CUDA_PROFILE", raising=False)
    for name in ("TINYLOOP_KV_INT8", "TINYLOOP_DISABLE_KV_CACHE", "TINYLOOP_TOKEN_EXIT"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("TINYLOOP_DISABLE_FLASH2_PREFILL", "1")  # applied at load
    assert main([str(tiny_files["f32"]), "benchmark", *SMALL, "--decode", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # the decode generates through the Model, in its KV mode (TINYLOOP_DISABLE_KV_CACHE wins: uncached)
    assert report["switches"] == {"disable_flash2_prefill": True, "disable_kv_cache": True, "kv_int8": True}
    assert report["not_applied"] == ["TINYLOOP_TOKEN_EXIT"]
    assert main([str(tiny_files["f32"]), "benchmark", *SMALL]) == 0  # no --decode: no cache anywhere
    text = capsys.readouterr().out
    assert "switches: disable_flash2_prefill=True\n" in text
    applied, ignored = text.split("not applied")
    assert "kv_int8" not in applied
    assert "TINYLOOP_DISABLE_KV_CACHE, TINYLOOP_KV_INT8, TINYLOOP_TOKEN_EXIT" in ignored


def test_log_level_2_says_what_was_loaded_allocated_and_captured_on_the_cpu(
    tiny_files, capsysbinary, monkeypatch
) -> None:
    monkeypatch.setenv("TINYLOOP_LOG_LEVEL", "2")
    args = [str(tiny_files["int8"]), "generate", "--prompt", "ab", "--max-tokens", "3", "--loops", "2"]
    assert main([*args, "--device", "cpu"]) == 0
    err = capsysbinary.readouterr().err.decode()
    cfg = preset("test-tiny")
    for part in ("embed", "prelude", "body", "coda", "final_norm"):
        assert f"loaded {part}: " in err and "as stored (int8" in err
    body = next(line for line in err.splitlines() if "loaded body:" in line)
    n_body = sum(spec.name.startswith("body.") for spec in model_specs(cfg))
    assert body.startswith(f"[tinyloop] loaded body: {n_body} tensors, ")
    assert "-> " in body and "(float32" in body and "on cpu" in body
    assert "allocated RoPE tables: 5 positions" in err  # sized for the run (2 + 3 tokens), not the header
    assert "decode: " in err and "nothing captured" in err
    slots = cfg.n_cache_slots(2)
    kv_mib = slots * 2 * 5 * cfg.kv_dim * 4 / 2**20
    assert (
        f"allocated a 16bit KV cache: {slots} slots (loops 2) x 5 positions x batch 1, float32, {kv_mib:.2f} MiB" in err
    )
    monkeypatch.setenv("TINYLOOP_LOG_LEVEL", "1")
    assert main([*args, "--device", "cpu"]) == 0
    assert b"loaded body" not in capsysbinary.readouterr().err


def test_no_nanobind_leak_report_at_exit() -> None:
    # The profile mode imports Triton through torch.profiler; its bindings used to list leaked objects at exit.
    env = {**os.environ, "TINYLOOP_CUDA_PROFILE": "1", "TINYLOOP_LOG_LEVEL": "0"}
    res = subprocess.run(
        [sys.executable, "-m", "tinyloop.cli.main", "tiny", "benchmark", *SMALL],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "segments" in res.stdout
    assert "nanobind" not in res.stderr and "leaked" not in res.stderr  # (torch.profiler prints its own lines)


def test_inspect_and_verify_through_the_dispatcher_stay_torch_free() -> None:
    code = (
        "import sys; from tinyloop.cli.main import main; "
        "codes = [main(['tiny', 'inspect']), main(['tiny', 'verify']), main(['tiny', 'inspect', '--bogus'])]; "
        "print(codes, [m for m in ('torch', 'numpy', 'triton') if m in sys.modules])"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip().splitlines()[-1] == "[0, 0, 2] []", res.stderr
