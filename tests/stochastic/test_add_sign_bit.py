"""`tinyloop-add-sign-bit`: channels from the float checkpoint, refusals of checkpoints that do not match."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tinyloop.cli.add_sign_bit import main
from tinyloop.format.reader import load_weights
from tinyloop.stochastic.channels import encode_channel, rounding_residual
from tinyloop.stochastic.weight import ChanneledInt4Weight

QKV = "body.0.attn.qkv.weight"


@pytest.mark.parametrize(("bits", "kind"), [(1, "sign"), (4, "frac4")])
def test_channels_come_from_the_checkpoint(
    files: dict[str, Path], floats: dict[str, torch.Tensor], tmp_path: Path, bits: int, kind: str, capsys
) -> None:
    out = tmp_path / "out.tinyloop"
    args = ["--from-pt", str(files["ckpt"]), "--loop-only", "--frac-bits", str(bits), "-i", str(files["int4"])]
    assert main([*args, "-o", str(out), "--quiet"]) == 0
    assert f"{kind} channel" in capsys.readouterr().out
    _, w = load_weights(out)
    for name in (QKV, "body.1.mlp.down.weight", "adapter.weight"):
        got = w[name]
        assert isinstance(got, ChanneledInt4Weight)
        assert torch.equal(got.channel, encode_channel(rounding_residual(floats[name], got), kind))  # type: ignore[arg-type]


def test_safetensors_checkpoint_and_existing_channels(files: dict[str, Path], floats, tmp_path: Path) -> None:
    ckpt = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in floats.items()}, str(ckpt))
    out = tmp_path / "out.tinyloop"
    # Input already has sign channels: they are replaced by frac4 ones.
    assert (
        main(["--from-pt", str(ckpt), "--loop-only", "--frac-bits", "4", "-i", str(files["sign"]), "-o", str(out)]) == 0
    )
    assert out.read_bytes() == files["frac4"].read_bytes()


def _refused(files: dict[str, Path], ckpt: dict[str, torch.Tensor], tmp_path: Path, capsys) -> str:
    path = tmp_path / "bad.pt"
    torch.save(ckpt, path)
    out = tmp_path / "never.tinyloop"
    code = main(["--from-pt", str(path), "--loop-only", "-i", str(files["int4"]), "-o", str(out), "--quiet"])
    assert code == 1 and not out.exists()
    return capsys.readouterr().err


def test_refuses_missing_extra_and_misshapen_tensors(files: dict[str, Path], floats, tmp_path: Path, capsys) -> None:
    missing = {k: v for k, v in floats.items() if k != QKV}
    assert f"missing tensors: {QKV}" in _refused(files, missing, tmp_path, capsys)
    extra = {**floats, "body.9.attn.qkv.weight": floats[QKV]}
    assert "unexpected tensors: body.9.attn.qkv.weight" in _refused(files, extra, tmp_path, capsys)
    shaped = {**floats, QKV: floats[QKV][:, :32]}
    assert f"{QKV}: expected shape" in _refused(files, shaped, tmp_path, capsys)


def test_refuses_weights_the_file_was_not_quantized_from(
    files: dict[str, Path], floats, tmp_path: Path, capsys
) -> None:
    other = {k: v + 0.05 * torch.randn_like(v) if k == QKV else v for k, v in floats.items()}
    err = _refused(files, other, tmp_path, capsys)
    assert f"tensor '{QKV}'" in err and "further away" in err


def test_needs_loop_only(files: dict[str, Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "x.tinyloop"
    assert main(["--from-pt", str(files["ckpt"]), "-i", str(files["int4"]), "-o", str(out)]) == 2
    assert "--loop-only" in capsys.readouterr().err and not out.exists()


def test_refuses_a_file_without_int4_looped_matrices(cfg, floats, tmp_path: Path, capsys) -> None:
    from tinyloop.format.writer import write_model

    f16 = tmp_path / "f16.tinyloop"
    write_model(f16, cfg, floats, bits=16, progress=False)
    ckpt = tmp_path / "w.pt"
    torch.save(floats, ckpt)
    assert main(["--from-pt", str(ckpt), "--loop-only", "-i", str(f16), "-o", str(tmp_path / "o.tinyloop")]) == 1
    assert "no INT4 looped matrices" in capsys.readouterr().err
