"""The Triton kernels give the torch reference's weights bit for bit (run on CPU by the Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from shared_data import require_module

require_module("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from tinyloop.kernels.triton_stochastic import draw_effective_weight, triton_effective_weight
    from tinyloop.quant import quantize_int4
    from tinyloop.stochastic.weight import reference_effective_weight
    from tinyloop.stochastic.channels import encode_channel, rounding_residual
    from tinyloop.stochastic.pcg import call_key
    from tinyloop.stochastic.weight import ChanneledInt4Weight

    gen = torch.Generator().manual_seed(0)
    checked = 0
    for out_f, in_f, group in ((6, 256, 64), (3, 640, 128), (5, 96, 32)):
        w = torch.randn(out_f, in_f, generator=gen) * 0.02
        w[0, :group] = 0.25  # a constant group (scale 0)
        w4 = quantize_int4(w, group)
        residual = rounding_residual(w, w4)
        for kind in ("sign", "frac4"):
            ch = encode_channel(residual, kind)
            cw = ChanneledInt4Weight(w4.packed, w4.scale, w4.minimum, group, ch, kind)
            for key in (2**31 + 5, 2**32 - 1, call_key(3, 7, 11)):
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    want = reference_effective_weight(cw, key, dtype)
                    got = triton_effective_weight(w4.packed, w4.scale, w4.minimum, ch, kind, group, key, dtype)
                    assert got.dtype == dtype and torch.equal(got, want), (out_f, in_f, kind, key, dtype)
                    assert torch.equal(draw_effective_weight(cw, key, dtype), want)
                    checked += 1
    print("identical", checked)

    # The fused decode matvec draws the same weights; only the summation order differs from a matmul.
    from tinyloop.kernels.triton_stochastic import stochastic_linear
    from tinyloop.stochastic.weight import StochasticInt4Weight

    for kind in ("sign", "frac4"):
        w = torch.randn(40, 192, generator=gen) * 0.02
        w4 = quantize_int4(w, 64)
        ch = encode_channel(rounding_residual(w, w4), kind)
        sw = StochasticInt4Weight(w4.packed, w4.scale, w4.minimum, 64, ch, kind, seed=5, call=2).at(3)
        for rows in (1, 3, 6):  # 6 rows: drawn once, then a dense matmul
            x = torch.randn(1, rows, 192, generator=gen)
            want = x.double() @ sw.dequantize(torch.float32).double().T
            got = stochastic_linear(x, sw)
            assert got.shape == (1, rows, 40)
            assert float((got.double() - want).abs().max()) < 1e-5, (kind, rows)
    print("matvec ok")
    """
)


def test_triton_kernel_matches_reference_bit_for_bit() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(src)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "identical 54" in proc.stdout and "matvec ok" in proc.stdout
