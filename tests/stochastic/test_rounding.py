"""Effective weights: against the naive float64 reference, reproducible per seed, unbiased in the mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from naive import effective_weight as naive_effective_weight
from naive import key as naive_key
from naive import pcg as naive_pcg

from tinyloop.quant import quantize_int4
from tinyloop.stochastic.channels import encode_channel, rounding_residual, unpack_nibbles
from tinyloop.stochastic.pcg import call_key, pcg_hash, pcg_hash_int, pcg_hash_np
from tinyloop.stochastic.rounding import effective_codes_np, effective_codes_torch
from tinyloop.stochastic.weight import ChanneledInt4Weight, StochasticInt4Weight

KINDS = ("sign", "frac4")


def channeled(w: torch.Tensor, kind: str, group: int = 64) -> ChanneledInt4Weight:
    w4 = quantize_int4(w, group)
    channel = encode_channel(rounding_residual(w, w4), kind)  # type: ignore[arg-type]
    return ChanneledInt4Weight(w4.packed, w4.scale, w4.minimum, group, channel, kind)  # type: ignore[arg-type]


def stochastic(w: torch.Tensor, kind: str, seed: int = 0, call: int = 0) -> StochasticInt4Weight:
    c = channeled(w, kind)
    return StochasticInt4Weight(c.packed, c.scale, c.minimum, c.group_size, c.channel, c.channel_kind, seed, call)


def test_pcg_backends_agree_with_pure_python() -> None:
    words = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1] + list(range(1000, 1100))
    expected = [naive_pcg(v) for v in words]
    assert [pcg_hash_int(v) for v in words] == expected
    assert pcg_hash(torch.tensor(words, dtype=torch.int64)).tolist() == expected
    assert pcg_hash_np(np.array(words, dtype=np.uint32)).tolist() == expected
    assert call_key(7, 3, 11) == naive_key(7, 3, 11)


def test_pcg_top_bits_are_uniform() -> None:
    r = pcg_hash(torch.arange(1 << 16, dtype=torch.int64) ^ call_key(0, 0, 0)) >> 27
    counts = torch.bincount(r, minlength=32).double()
    # 2048 expected per bucket; 6 sigma is about 270.
    assert float((counts - 2048).abs().max()) < 270


@pytest.mark.parametrize("kind", KINDS)
def test_matches_naive_float64_reference(kind: str) -> None:
    w = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    w[1, :64] = 0.5  # a constant group: scale 0
    sw = stochastic(w, kind, seed=9, call=4)
    for iteration in (0, 1, 17):
        k = naive_key(9, iteration, 4)
        want = naive_effective_weight(w, 64, kind, k)
        got = sw.at(iteration).dequantize(torch.float32)
        # Products of a 4-bit code and an fp16 scale are exact, so one float32 rounding of the float64 sum.
        assert torch.equal(got, want.to(torch.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_numpy_and_torch_paths_give_the_same_codes(kind: str) -> None:
    c = channeled(torch.randn(16, 256) * 0.02, kind)
    for key in (0, 5, 2**31 + 3, 2**32 - 1):
        a = torch.from_numpy(effective_codes_np(c.packed.numpy(), c.channel.numpy(), kind, key))  # type: ignore[arg-type]
        b = effective_codes_torch(c.packed, c.channel, kind, key)  # type: ignore[arg-type]
        assert torch.equal(a, b)
        assert int(a.max()) <= 15


@pytest.mark.parametrize("kind", KINDS)
def test_reproducible_per_seed_and_fresh_per_iteration(kind: str) -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) * 0.02
    a = stochastic(w, kind, seed=1, call=2)
    assert torch.equal(a.at(3).dequantize(), stochastic(w, kind, seed=1, call=2).at(3).dequantize())
    base = a.at(3).dequantize()
    for other in (a.at(4), stochastic(w, kind, seed=2, call=2).at(3), stochastic(w, kind, seed=1, call=3).at(3)):
        assert not torch.equal(base, other.dequantize())
    # Unbound (outside the loop) it is the plain INT4 weight.
    assert torch.equal(a.dequantize(), quantize_int4(w, 64).dequantize())


def _mean_over_iterations(w: torch.Tensor, kind: str, n: int) -> tuple[torch.Tensor, StochasticInt4Weight]:
    sw = stochastic(w, kind, seed=5, call=1)
    acc = torch.zeros(w.shape, dtype=torch.float64)
    for t in range(n):
        acc += sw.at(t).dequantize().double()
    return acc / n, sw


N_DRAWS = 1024


def test_frac4_mean_converges_to_the_float_weight() -> None:
    """Per weight, E[w_eff] = q*s + m + s*(2k - 15)/32, which is within s/32 of the float weight (the residual
    is stored to 1/16 of a step, read at its bucket's middle); the draws' mean is within 5 standard errors."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    mean, sw = _mean_over_iterations(w, "frac4", N_DRAWS)
    steps = sw.scale.double().repeat_interleave(64, dim=1)
    stderr = steps * 0.5 / N_DRAWS**0.5
    assert bool(((mean - w.double()).abs() <= steps / 32 + 5 * stderr + 1e-7).all())
    int4_err = (sw.dequantize().double() - w.double()).norm()
    # Over the whole matrix: the mean is ~15x closer to the float weights than nearest rounding.
    assert float((mean - w.double()).norm()) < 0.1 * float(int4_err)


def test_sign_bit_halves_the_bias_but_is_not_unbiased_per_weight() -> None:
    """The 1-bit channel moves toward the float weight with probability 1/4: E[w_eff] = q*s + m +- s/4, the
    mean |residual| of uniformly spread residuals. Unbiased only on average over weights, not per weight:
    the RMS bias drops from s/sqrt(12) to s/sqrt(48) (half)."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)) * 0.02
    mean, sw = _mean_over_iterations(w, "sign", N_DRAWS)
    int4 = sw.dequantize().double()
    steps = sw.scale.double().repeat_interleave(64, dim=1)
    moved = (mean - int4) / steps  # in steps: +-1/4 expected, except where the clamp holds a code at 0 or 15
    free = (moved.abs() > 0.1).double().mean()
    assert float(free) > 0.95
    assert float((moved.abs()[moved.abs() > 0.1] - 0.25).abs().max()) < 5 * 0.433 / N_DRAWS**0.5
    ratio = float((mean - w.double()).norm() / (int4 - w.double()).norm())
    assert 0.4 < ratio < 0.6
    residual = (w.double() - int4) / steps
    # Per weight the bias |e| - 1/4 remains, e.g. a weight whose residual is 0.45 steps keeps 0.2 of it.
    far = residual.abs() > 0.45
    assert float(((mean - w.double()).abs() / steps)[far].min()) > 0.15


def test_unpack_round_trip() -> None:
    q = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    assert torch.equal(unpack_nibbles(packed), q.long())
