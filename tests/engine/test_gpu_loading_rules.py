"""CPU-checkable rules of the CUDA loading path: compute dtype choice, which weights stay packed."""

from __future__ import annotations

import torch

from helpers import random_flat_weights
from tinyloop.config import ArchConfig
from tinyloop.kernels.attention_backend import sdpa
from tinyloop.presets import preset
from tinyloop.quant import BlockedInt4Weight, Int4Weight, quantize_int4
from tinyloop.runtime.loader import FLOAT32_MAX_WIDTH, default_dtype, prepare_weights
from tinyloop.train.tiny_config import TINY_CONFIG


def test_small_models_compute_in_float32_on_cuda() -> None:
    cuda = torch.device("cuda")
    assert TINY_CONFIG.d_model <= FLOAT32_MAX_WIDTH
    assert default_dtype(cuda, TINY_CONFIG) == torch.float32
    assert default_dtype(cuda, preset("seed-407m")) == torch.bfloat16
    assert default_dtype(torch.device("cpu"), preset("seed-407m")) == torch.float32


def test_keep_int4_leaves_matrices_packed_and_dense_body_dequantizes_the_body() -> None:
    cfg = ArchConfig(
        vocab_size=64, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=128,
        n_prelude=1, n_body=1, n_coda=1, injection="add",
    )  # fmt: skip
    flat = random_flat_weights(cfg)
    packed = {n: quantize_int4(t, 32) if t.dim() == 2 else t for n, t in flat.items()}
    cpu = torch.device("cpu")
    kept = prepare_weights(packed, cpu, torch.float32, keep_int4=True)
    assert isinstance(kept["prelude.0.attn.qkv.weight"], Int4Weight)
    assert isinstance(kept["body.0.mlp.down.weight"], Int4Weight)
    body_dense = prepare_weights(packed, cpu, torch.bfloat16, keep_int4=True, dense_body=True)
    down = body_dense["body.0.mlp.down.weight"]
    assert isinstance(down, torch.Tensor) and down.dtype == torch.bfloat16
    assert torch.equal(down.float(), packed["body.0.mlp.down.weight"].dequantize().bfloat16().float())  # type: ignore[union-attr]
    assert isinstance(body_dense["coda.0.mlp.down.weight"], Int4Weight)
    default = prepare_weights(packed, cpu, torch.float32)
    assert all(not isinstance(w, Int4Weight) for w in default.values())


def test_keep_int4_repacks_plain_int4_into_the_blocked_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    packed = {"a.weight": quantize_int4(torch.randn(8, 128, generator=gen), 64),
              "b.weight": quantize_int4(torch.randn(8, 128, generator=gen), 32)}  # fmt: skip
    kept = prepare_weights(packed, torch.device("cpu"), torch.float32, keep_int4=True)
    for name in packed:  # repacked (64- and 32-column blocks), same values
        assert isinstance(kept[name], BlockedInt4Weight)
        assert torch.equal(kept[name].dequantize(), packed[name].dequantize())


def test_attention_backend_on_cpu_is_plain_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=gen) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(sdpa(q, k, v, causal=True), want)
