"""`tinyloop <model> benchmark`: report fields, the JSON schema, profile-mode segments, one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tinyloop.cli import args as cli_args
from tinyloop.cli.main import main
from tinyloop.runtime.benchmark import (
    BenchmarkConfig,
    segmented_forward,
    synthetic_tokens,
    work_kind,
    write_preset_model,
)
from tinyloop.runtime.loader import load_engine

SMALL = ["--seq-len", "8", "--repeat", "2", "--loops", "2", "--device", "cpu"]


def bench(capsys, path, *flags: str) -> tuple[int, str, str]:
    code = main([str(path), "benchmark", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_text_report_has_latency_and_throughput(tiny_files, capsys, monkeypatch) -> None:
    monkeypatch.delenv("TINYLOOP_CUDA_PROFILE", raising=False)
    code, out, _ = bench(capsys, tiny_files["int4"], *SMALL)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("model: test-tiny (test-tiny-int4.tinyloop), 4-bit g32")
    assert "loops 2, seq-len 8, batch 1, repeat 2, warm-up 1 run" in out
    forward = next(line for line in lines if line.startswith("forward:"))
    for field in ("median", "min", "max", "tokens/s"):
        assert field in forward
    assert "decode:" not in out and "segments" not in out


def test_json_holds_every_number(tiny_files, capsys, monkeypatch) -> None:
    monkeypatch.delenv("TINYLOOP_CUDA_PROFILE", raising=False)
    code, out, _ = bench(capsys, tiny_files["f16"], *SMALL, "--batch", "2", "--decode", "3", "--json")
    assert code == 0
    report = json.loads(out)  # one object, nothing else on stdout
    assert report["device"] == "cpu" and report["device_name"] and report["torch_version"] == torch.__version__
    assert (report["loops"], report["seq_len"], report["batch"], report["repeat"]) == (2, 8, 2, 2)
    assert report["decode_tokens"] == 3 and report["warmup"] is True and report["profile"] is False
    assert report["model"]["name"] == "test-tiny" and report["model"]["layers"] == {"prelude": 1, "body": 2, "coda": 1}
    assert report["quantization"]["bits"] == 16
    fwd = report["forward"]
    assert fwd["runs"] == 2 and 0 < fwd["min_ms"] <= fwd["median_ms"] <= fwd["max_ms"]
    assert fwd["tokens_per_s"] == pytest.approx(2 * 8 / (fwd["median_ms"] / 1e3))
    dec = report["decode"]
    assert dec["tokens"] == 3 and dec["prefill"]["runs"] == 3 and dec["decode"]["runs"] == 3
    assert dec["ms_per_token"] == pytest.approx(dec["decode"]["median_ms"] / 3)
    assert dec["tokens_per_s"] == pytest.approx(2 * 3 / (dec["decode"]["median_ms"] / 1e3))
    assert "segments" not in report


def test_dtype_bfloat16_on_cpu_reports_bfloat16_matmuls(tiny_files, capsys, monkeypatch) -> None:
    monkeypatch.delenv("TINYLOOP_CUDA_PROFILE", raising=False)
    code, out, err = bench(capsys, tiny_files["int4"], *SMALL, "--decode", "2", "--dtype", "bfloat16", "--json")
    assert code == 0 and "INT4 matmuls in bfloat16" in err
    model = json.loads(out)["model"]
    assert (model["compute_dtype"], model["matmul_dtype"]) == ("float32", "bfloat16")
    code, out, _ = bench(capsys, tiny_files["int4"], *SMALL, "--dtype", "bfloat16")
    assert code == 0 and "float32, bfloat16 matmuls" in out.splitlines()[1]
    # --dtype auto: float32 on a CPU without native bfloat16, bfloat16 matmuls with it (cli/args.py).
    for flags, matmul in ((frozenset({"avx2"}), "float32"), (frozenset({"avx512_bf16"}), "bfloat16")):
        monkeypatch.setattr(cli_args, "cpu_flags", lambda flags=flags: flags)
        code, out, _ = bench(capsys, tiny_files["int4"], *SMALL, "--json")
        model = json.loads(out)["model"]
        assert (model["compute_dtype"], model["matmul_dtype"]) == ("float32", matmul)


def test_profile_mode_skips_warmup_and_times_each_segment(tiny_files, capsys, monkeypatch) -> None:
    monkeypatch.setenv("TINYLOOP_CUDA_PROFILE", "1")
    code, out, _ = bench(
        capsys, tiny_files["int8"], "--seq-len", "8", "--repeat", "2", "--loops", "3", "--device", "cpu"
    )
    assert code == 0
    assert "warm-up skipped (TINYLOOP_CUDA_PROFILE=1)" in out
    names = [line.split()[0:2] for line in out.splitlines() if line.startswith("  ")]
    assert [" ".join(n) if n[0] == "loop" else n[0] for n in names] == [
        "embedding", "prelude", "loop 1", "loop 2", "loop 3", "coda", "head", "total",
    ]  # fmt: skip
    work = next(line for line in out.splitlines() if line.startswith("work"))
    assert "attention" in work and "matrix" in work and "other" in work

    code, out, _ = bench(
        capsys, tiny_files["int8"], "--seq-len", "8", "--repeat", "2", "--loops", "3", "--device", "cpu", "--json"
    )
    report = json.loads(out)
    assert report["warmup"] is False and report["profile"] is True and report["switches"]["cuda_profile"] is True
    assert list(report["segments"]) == ["embedding", "prelude", "loop 1", "loop 2", "loop 3", "coda", "head"]
    assert all(s["runs"] == 2 and s["median_ms"] >= 0 for s in report["segments"].values())
    assert set(report["work_ms"]) == {"attention", "matrix", "other"} and report["work_ms"]["matrix"] > 0


def test_segmented_forward_computes_the_engine_logits(tiny_files) -> None:
    _, engine = load_engine(tiny_files["f32"], torch.device("cpu"))
    tokens = synthetic_tokens(256, 2, 12, seed=5)
    logits, segments = segmented_forward(engine, tokens, 3)
    ref = engine.step(tokens, None, 3).logits
    assert ref is not None
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert list(segments) == ["embedding", "prelude", "loop 1", "loop 2", "loop 3", "coda", "head"]


def test_synthetic_tokens_are_seeded_and_never_zero() -> None:
    a = synthetic_tokens(256, 3, 500, seed=1)
    assert a.shape == (3, 500) and a.dtype == torch.long
    assert bool((a > 0).all()) and bool((a < 256).all())
    assert torch.equal(a, synthetic_tokens(256, 3, 500, seed=1))
    assert not torch.equal(a, synthetic_tokens(256, 3, 500, seed=2))
    assert bool((synthetic_tokens(2, 1, 50) == 1).all())


def test_preset_model_is_written_once(tmp_path) -> None:
    path = write_preset_model("test-tiny", tmp_path, bits=4)
    assert path.name == "test-tiny-4bit-seed0.tinyloop"
    stamp = path.stat().st_mtime_ns
    assert write_preset_model("test-tiny", tmp_path, bits=4) == path and path.stat().st_mtime_ns == stamp
    from tinyloop.format.header import read_header

    header = read_header(path)
    assert header.config.name == "test-tiny" and header.quantization.bits == 4


def test_work_kinds() -> None:
    assert work_kind("aten::scaled_dot_product_attention") == "attention"
    assert work_kind("flash_fwd_kernel") == "attention"
    assert work_kind("aten::linear") == "matrix"
    assert work_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "matrix"
    assert work_kind("aten::mul") == "other"


def test_config_check_names_the_value() -> None:
    from tinyloop.presets import preset

    cfg = preset("test-tiny")  # max_position 1024
    BenchmarkConfig(seq_len=1024).check(cfg)
    with pytest.raises(ValueError, match="seq_len 1025"):
        BenchmarkConfig(seq_len=1025).check(cfg)
    with pytest.raises(ValueError, match="decode 2"):
        BenchmarkConfig(seq_len=1023, decode=2).check(cfg)
    with pytest.raises(ValueError, match="batch"):
        BenchmarkConfig(batch=0).check(cfg)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--loops", "0"], "--loops"),
        (["--seq-len", "-4"], "--seq-len"),
        (["--repeat", "x"], "--repeat"),
        (["--batch", "0"], "--batch"),
        (["--decode", "-1"], "--decode"),
        (["--decode-repeat", "0"], "--decode-repeat"),
        (["--seq-len", "1025"], "--seq-len 1025 exceeds the model's maximum position 1024"),
        (["--seq-len", "1000", "--decode", "25"], "--seq-len 1000 + --decode 25 exceeds"),
        (["--device", "tpu"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--no-such-flag"], "unrecognized"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tiny_files, capsys, flags, needle) -> None:
    code, out, err = bench(capsys, tiny_files["int4"], *flags)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_command_line_end_to_end(tiny_files) -> None:
    env = {**os.environ, "TINYLOOP_LOG_LEVEL": "1", "TINYLOOP_CUDA_PROFILE": "0"}
    res = subprocess.run(
        [sys.executable, "-m", "tinyloop.cli.main", str(tiny_files["int4"]), "benchmark", *SMALL, "--json"],
        capture_output=True, timeout=120, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["forward"]["runs"] == 2
    usage = subprocess.run([sys.executable, "-m", "tinyloop.cli.main", "--help"], capture_output=True, timeout=60)
    assert b"benchmark" in usage.stdout


def load_plain_baseline() -> ModuleType:
    """bench/plain_torch_looped.py, the plain PyTorch baseline of bench/cpu_decode_vs_plain.py."""
    path = Path(__file__).resolve().parents[2] / "bench" / "plain_torch_looped.py"
    spec = importlib.util.spec_from_file_location("plain_torch_looped", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_plain_torch_baseline_matches_the_engine(tiny_files) -> None:
    plain_mod = load_plain_baseline()
    plain = plain_mod.PlainLoopedLM.from_tinyloop(tiny_files["int4"])  # GQA, concat injection, zero start
    _, engine = load_engine(tiny_files["int4"], torch.device("cpu"))
    tokens = synthetic_tokens(256, 1, 10, seed=3)
    with torch.inference_mode():
        logits = plain(tokens, 3)
    ref = engine.step(tokens, None, 3).logits
    assert ref is not None
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)

    # Greedy decoding through its growing cache follows the engine's cached steps.
    run = plain_mod.greedy_generate(plain, tokens[0].tolist(), 6, 3)
    cache = engine.new_cache(1, 16, 3)
    step = engine.step(tokens, cache, 3, last_only=True).logits
    expected = []
    for _ in range(6):
        assert step is not None
        expected.append(int(step[0, -1].argmax()))
        step = engine.step(torch.tensor([[expected[-1]]]), cache, 3, last_only=True).logits
    assert run.tokens == expected and run.prefill_s > 0 and run.decode_s > 0
