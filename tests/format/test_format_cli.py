"""`tinyloop FILE inspect` / `verify` and `tinyloop-convert`: output, exit codes, and staying torch-free."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from format_helpers import src_env
from safetensors.torch import save_file

from tinyloop.cli.convert import main as convert_main
from tinyloop.cli.inspect_cmd import kv_bytes, run_inspect
from tinyloop.cli.verify_cmd import run_verify
from tinyloop.config import ArchConfig
from tinyloop.convert.random_model import random_weights
from tinyloop.format import load_weights, read_header
from tinyloop.format.encode import HeaderPlan
from tinyloop.format.spec import plan_quantization
from tinyloop.layout import parameter_count
from tinyloop.presets import preset

HEAVY = ("torch", "numpy", "safetensors", "tqdm")


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=src_env(), timeout=60, check=False
    )


def test_inspect_modules_do_not_import_torch() -> None:
    code = (
        "import sys, tinyloop.cli.inspect_cmd, tinyloop.cli.verify_cmd, tinyloop.format; "
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_inspect_json(format_files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert run_inspect(str(format_files["4"]), ["--json", "--max-seq-len", "100"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = preset("test-tiny")
    assert report["format_version"] == "1.1"
    assert report["quantization"]["bits"] == 4 and report["quantization"]["group_size"] == 64
    assert report["parameters"] == parameter_count(cfg)
    assert report["weight_bytes"] == read_header(format_files["4"]).weight_bytes
    assert report["model"]["n_kv_heads"] == 2 and report["embedding"]["tied"] is True
    rows = {r["seq_len"]: r for r in report["buffers"]["per_seq_len"]}
    assert sorted(rows) == [100, 512, 2048, 8192]
    slots = cfg.n_cache_slots(cfg.default_loops)
    # d_model 64: float32 on CUDA as on the CPU (4 bytes per value)
    assert report["buffers"]["kv_dtype"] == {"cpu": "float32", "cuda": "float32"}
    for kv in (rows[2048]["kv_bytes"]["cpu"], rows[2048]["kv_bytes"]["cuda"]):
        assert kv["dense"] == slots * 2048 * 2 * cfg.kv_dim * 4
        assert kv["int8"] == slots * 2048 * 2 * (cfg.kv_dim + 2 * cfg.n_kv_heads)
        assert kv["window-512"] == rows[512]["kv_bytes"]["cpu"]["dense"]
        assert kv["hidden"] == slots * 2048 * cfg.d_model * 4
        assert kv["none"] == 0
    assert rows[100]["kv_bytes"]["cpu"]["window-512"] == rows[100]["kv_bytes"]["cpu"]["dense"]
    assert report["compression_vs_fp16"] > 3


def test_inspect_text_and_errors(format_files: dict[str, Path], tmp_path: Path, capsys) -> None:
    assert run_inspect(str(format_files["8"]), []) == 0
    out = capsys.readouterr().out
    assert "tinyloop 1.1" in out and "INT8" in out and "d_model 64" in out and "8192" in out
    assert "CPU and CUDA: float32" in out
    bad = tmp_path / "bad.tinyloop"
    bad.write_bytes(b"\0" * 20)
    assert run_inspect(str(bad), []) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tinyloop: error: ") and str(bad) in err and "\n" not in err
    assert run_inspect(str(format_files["8"]), ["--bogus"]) == 2
    assert run_inspect(str(format_files["8"]), ["--max-seq-len", "0"]) == 2


def test_kv_modes_unknown() -> None:
    with pytest.raises(ValueError):
        kv_bytes(preset("test-tiny"), "fp8", 10, 1, 4)


def test_inspect_reads_only_the_header_of_a_sparse_407m_file(tmp_path: Path) -> None:
    # The data section is a hole (all zeros, never written): inspect must still describe the model,
    # in a process that never imports torch.
    cfg = preset("seed-407m")
    plan = HeaderPlan(cfg, plan_quantization(cfg, 4, 64, "F16"))
    path = tmp_path / "seed.tinyloop"
    with open(path, "wb") as f:
        f.write(plan.prefix())
        f.truncate(plan.data_start + plan.data_bytes)
    code = (
        "import sys, json; from tinyloop.cli.inspect_cmd import run_inspect; "
        "rc = run_inspect(sys.argv[1], ['--json']); "
        f"assert not [m for m in {HEAVY!r} if m in sys.modules]; sys.exit(rc)"
    )
    result = run_python(code, str(path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["parameters"] == parameter_count(cfg)
    assert report["weight_bytes"] == plan.data_bytes
    assert report["buffers"]["kv_slots"] == cfg.n_cache_slots(8)
    # d_model 2048: bfloat16 on CUDA, float32 on the CPU (twice the bytes)
    row = report["buffers"]["per_seq_len"][0]["kv_bytes"]
    assert report["buffers"]["kv_dtype"] == {"cpu": "float32", "cuda": "bfloat16"}
    assert row["cpu"]["dense"] == 2 * row["cuda"]["dense"] and row["cpu"]["int8"] == row["cuda"]["int8"]


def test_inspect_kv_estimate_is_what_a_cpu_run_allocates(format_files: dict[str, Path], capsys) -> None:
    import tinyloop
    from tinyloop.cli import inspect_cmd
    from tinyloop.runtime import loader

    assert inspect_cmd.FLOAT32_MAX_WIDTH == loader.FLOAT32_MAX_WIDTH
    assert run_inspect(str(format_files["4"]), ["--json"]) == 0
    row = json.loads(capsys.readouterr().out)["buffers"]["per_seq_len"][0]
    cfg = preset("test-tiny")
    for mode, kv_mode in (("dense", "16bit"), ("int8", "int8"), ("hidden", "hidden")):
        with tinyloop.Model(format_files["4"], device="cpu", kv_mode=kv_mode) as m:
            assert row["kv_bytes"]["cpu"][mode] == row["seq_len"] * m.kv_bytes_per_token(cfg.default_loops)


def test_verify(format_files: dict[str, Path], tmp_path: Path, capsys) -> None:
    assert run_verify(str(format_files["4"]), []) == 0
    assert capsys.readouterr().out.startswith("OK")
    header = read_header(format_files["4"])
    entry = header.tensors["final_norm.weight"]
    raw = bytearray(format_files["4"].read_bytes())
    raw[header.data_start + entry.start] ^= 1
    path = tmp_path / "bad.tinyloop"
    path.write_bytes(raw)
    assert run_verify(str(path), []) == 1
    out = capsys.readouterr().out
    assert "CORRUPTED" in out and "final_norm.weight" in out
    path.write_bytes(raw[:-3])
    assert run_verify(str(path), []) == 1
    assert capsys.readouterr().err.startswith("tinyloop: error: ")


def test_convert_random(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.tinyloop"
    argv = ["--random", "--preset", "test-tiny", "-o", str(out), "--seed", "3", "--bits", "4", "--group-size", "32"]
    assert convert_main(argv) == 0
    header = read_header(out)
    assert header.quantization.bits == 4 and header.quantization.group_size == 32
    assert header.config == preset("test-tiny")
    assert convert_main(["--random", "--preset", "test-tiny", "-o", str(out), "--float-dtype", "bf16"]) == 0
    assert read_header(out).quantization.float_dtype == "BF16"
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv",
    [
        ["--random", "--preset", "nope", "-o", "x"],
        ["--random", "-o", "x"],
        ["--random", "--preset", "test-tiny"],
        ["--random", "--preset", "test-tiny", "-o", "x", "--bits", "5"],
        ["ckpt.pt", "-o", "x"],
        ["ckpt.pt", "--random", "--preset", "test-tiny", "-o", "x"],
        ["--from-hf", "some/dir", "-o", "x"],
        ["missing.pt", "--config", "missing.json", "-o", "x"],
    ],
)
def test_convert_usage_errors(argv: list[str], capsys) -> None:
    assert convert_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tinyloop-convert: error: ") and "\n" not in err


def _write_config(tmp_path: Path, cfg: ArchConfig) -> Path:
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    return path


def test_convert_torch_checkpoint(tmp_path: Path, tiny_cfg: ArchConfig, capsys) -> None:
    weights = random_weights(tiny_cfg, seed=5)
    ckpt = tmp_path / "ckpt.pt"
    nested = {"model": {f"_orig_mod.{k}": v for k, v in weights.items()}, "step": 3}
    torch.save(nested, ckpt)
    out = tmp_path / "m.tinyloop"
    assert convert_main([str(ckpt), "--config", str(_write_config(tmp_path, tiny_cfg)), "-o", str(out)]) == 0
    _, loaded = load_weights(out)
    for name, w in weights.items():
        got = loaded[name]
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, w.to(got.dtype))
    capsys.readouterr()


def test_convert_safetensors_checkpoint_errors(tmp_path: Path, tiny_cfg: ArchConfig, capsys) -> None:
    weights = {f"module.{k}": v for k, v in random_weights(tiny_cfg, seed=5).items()}
    del weights["module.embed.weight"]
    weights["module.extra.weight"] = torch.zeros(2)
    weights["module.final_norm.weight"] = torch.zeros(3)
    ckpt = tmp_path / "ckpt.safetensors"
    save_file(weights, str(ckpt))
    out = tmp_path / "m.tinyloop"
    assert convert_main([str(ckpt), "--config", str(_write_config(tmp_path, tiny_cfg)), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "embed.weight" in err and "extra.weight" in err and "final_norm.weight" in err
    assert not out.exists()


def test_convert_bad_checkpoint_and_config(tmp_path: Path, tiny_cfg: ArchConfig, capsys) -> None:
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"not a checkpoint")
    cfg_path = _write_config(tmp_path, tiny_cfg)
    assert convert_main([str(ckpt), "--config", str(cfg_path), "-o", str(tmp_path / "m.tinyloop")]) == 2
    assert "checkpoint" in capsys.readouterr().err
    cfg_path.write_text('{"d_model": 3}')
    assert convert_main([str(ckpt), "--config", str(cfg_path), "-o", str(tmp_path / "m.tinyloop")]) == 2
    assert "config" in capsys.readouterr().err


def test_random_weights_are_deterministic_and_not_degenerate(tiny_cfg: ArchConfig) -> None:
    a, b, c = random_weights(tiny_cfg, 0), random_weights(tiny_cfg, 0), random_weights(tiny_cfg, 1)
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
        assert a[name].dtype == torch.float32 and bool(a[name].abs().sum() > 0)
    assert abs(float(a["final_norm.weight"].mean()) - 1.0) < 0.05
    assert float(a["body.0.mlp.down.weight"].std()) < float(a["body.0.mlp.gate_up.weight"].std())
