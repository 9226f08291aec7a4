"""A deliberately naive float64 / pure-Python model of cross-iteration rounding, one weight at a time."""

from __future__ import annotations

import math

import torch


def pcg(v: int) -> int:
    state = (v * 747796405 + 2891336453) % 2**32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) % 2**32
    return (word >> 22) ^ word


def key(seed: int, iteration: int, call: int) -> int:
    return pcg((pcg((pcg(seed) + iteration) % 2**32) + call) % 2**32)


def effective_weight(w: torch.Tensor, group: int, kind: str, k: int) -> torch.Tensor:
    """From float weights, quantize, find each residual, draw the effective weight; float64 throughout."""
    out_f, in_f = w.shape
    res = torch.zeros(out_f, in_f, dtype=torch.float64)
    for o in range(out_f):
        for g in range(in_f // group):
            vals = [float(w[o, g * group + j]) for j in range(group)]
            lo = float(torch.tensor(min(vals)).to(torch.float16))
            # The file's scale is fp16((max - min) / 15) evaluated in float32, as the writer does.
            span = torch.tensor(max(vals), dtype=torch.float32) - torch.tensor(min(vals), dtype=torch.float32)
            scale = float((span / 15.0).to(torch.float16))
            for j in range(group):
                i = g * group + j
                u = (vals[j] - lo) / scale if scale > 0 else 0.0
                q = min(max(round(u), 0), 15) if scale > 0 else round(vals[j] - lo)
                e = u - q if scale > 0 else 0.0
                if kind == "sign":
                    up, p32 = e > 0, 8
                else:
                    bucket = min(max(math.floor(16 * (e + 0.5)), 0), 15)
                    up, p32 = bucket >= 8, abs(2 * bucket - 15)
                r = pcg(((o * in_f + i) ^ k) % 2**32) >> 27
                if r < p32:
                    q = min(max(q + (1 if up else -1), 0), 15)
                res[o, i] = q * scale + lo
    return res
