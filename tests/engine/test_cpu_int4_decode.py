"""A model loaded with bfloat16 INT4 matmuls on the CPU (kernels/cpu_int4.py): the CPU decode step and the
generic forward against the naive float64 reference of the same INT4 weights."""

from __future__ import annotations

import pytest
import torch
from test_cached_vs_naive import BASE, VARIANTS
from test_cpu_decode import draft_then_verify, fast_step

from helpers import frob_rel_error, random_flat_weights
from naive_reference import naive_forward
from shared_data import unavailable
from tinyloop.config import ArchConfig
from tinyloop.kernels import cpu_int4
from tinyloop.layout import model_specs
from tinyloop.model.looped import Resume
from tinyloop.model.weights import ModelWeights
from tinyloop.quant import CpuInt4Weight, Int4Weight, quantize_int4
from tinyloop.runtime.cpu_decode import CpuDecoder
from tinyloop.runtime.decode_path import StepInput
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.loader import prepare_weights

if not cpu_int4.available():
    unavailable(f"torch {torch.__version__} has no CPU INT4 kernel (torch._weight_int4pack_mm_for_cpu)")

# Relative Frobenius error of a whole model whose every matmul rounds its input and output to bfloat16
# (measured: 0.5-2.2 % over these variants; wrong codes, scales or rows give errors of order 1).
MODEL_TOL = 4e-2

# Widths the INT4 groups divide; vocab 112 packs the head, 97 leaves it float32.
SHAPES = dict(d_model=64, head_dim=16, ffn_dim=96)


def _engines(variant: str, vocab: int) -> tuple[ArchConfig, dict[str, torch.Tensor], Engine, Engine]:
    """The INT4 model with bfloat16 INT4 matmuls (CPU decoder on, and generic only), and its float weights."""
    cfg = ArchConfig(**{**BASE, **VARIANTS[variant], **SHAPES, "vocab_size": vocab})  # type: ignore[arg-type]
    flat = random_flat_weights(cfg, seed=11)
    matrices = {s.name for s in model_specs(cfg) if s.role != "vector" and not s.name.startswith("exit_gate.")}
    quantized = {n: quantize_int4(t, 32) if n in matrices else t for n, t in flat.items()}
    dequantized = {n: w.dequantize(torch.float32) if isinstance(w, Int4Weight) else w for n, w in quantized.items()}
    cpu = torch.device("cpu")

    def engine() -> Engine:
        weights = prepare_weights(quantized, cpu, torch.float32, int4_matmuls=True)
        return Engine(cfg, ModelWeights.from_flat(cfg, weights), cpu, torch.float32)

    fast, generic = engine(), engine()
    generic.decoder = None
    assert isinstance(fast.decoder, CpuDecoder)
    assert all(isinstance(w, CpuInt4Weight) for w in fast.weights.body[0].matrices())
    assert isinstance(fast.weights.head, CpuInt4Weight) == (vocab % 16 == 0)
    return cfg, dequantized, fast, generic


@pytest.mark.parametrize(("variant", "vocab"), [("pre-concat-zeros-gqa", 112), ("huginn-like", 97),
                                                ("ouro-like", 112), ("mqa-interleaved-qkbias", 112)])  # fmt: skip
def test_model_with_int4_matmuls_matches_naive(variant: str, vocab: int) -> None:
    cfg, dequantized, fast, generic = _engines(variant, vocab)
    loops, prompt = 3, 4
    tokens = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(12)).tolist()
    ref, _, _ = naive_forward(cfg, dequantized, tokens, loops, fast.noise)
    caches = (fast.new_cache(1, 32, loops), generic.new_cache(1, 32, loops))
    outs: list[list[torch.Tensor]] = [[], []]
    for i, (engine, cache) in enumerate(zip((fast, generic), caches, strict=True)):
        first = engine.step(torch.tensor([tokens[:prompt]]), cache, loops)
        assert first.logits is not None
        outs[i].append(first.logits[0])
        for t in tokens[prompt:]:
            new = torch.tensor([[t]])
            if engine is fast:
                out = fast_step(fast, new, cache, loops)
            else:
                out = engine.step(new, cache, loops, last_only=True)
            assert out.logits is not None and out.logits.dtype == torch.float32
            outs[i].append(out.logits[0])
    got_fast, got_generic = torch.cat(outs[0]), torch.cat(outs[1])
    assert frob_rel_error(got_fast, ref) <= MODEL_TOL, "CPU decoder against the naive reference"
    assert frob_rel_error(got_generic, ref) <= MODEL_TOL, "generic forward against the naive reference"
    # The two paths round the same matmul inputs, so they agree more closely than either with float64.
    assert frob_rel_error(got_fast, got_generic) <= MODEL_TOL / 4


def test_builtin_model_in_bfloat16_generates_as_float32(capsys: pytest.CaptureFixture[str]) -> None:
    import tinyloop

    exact = tinyloop.Model("tiny")
    fast = tinyloop.Model("tiny", dtype=torch.bfloat16)
    assert "INT4 matmuls in bfloat16" in capsys.readouterr().err
    assert isinstance(fast._engine.decoder, CpuDecoder) and fast._engine.dtype == torch.float32
    assert isinstance(fast._engine.weights.body[0].qkv, CpuInt4Weight)
    prompt = list(b"def fibonacci(n):\n")
    want = exact.generate(prompt, max_tokens=32, temperature=0)
    got = fast.generate(prompt, max_tokens=32, temperature=0)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize(("variant", "vocab"), [("pre-concat-zeros-gqa", 112), ("huginn-like", 97)])
def test_verification_with_int4_matmuls_matches_naive(variant: str, vocab: int) -> None:
    """A verify pass resumed from drafted states runs on the CPU decoder up to INT4_MAX_ROWS rows (the one-row
    steps' kernel), within bfloat16's error of the naive reference; more rows take the generic forward."""
    cfg, dequantized, fast, generic = _engines(variant, vocab)
    prompt, drafts = [5, 9, 2, 7, 1, 3], [11, 12, 13, 14, 15]
    naive, _, _ = naive_forward(cfg, dequantized, prompt + drafts, 5, fast.noise)
    got = []
    for engine in (fast, generic):
        out, _ = draft_then_verify(engine, prompt, drafts, engine is fast)
        assert out.logits is not None
        got.append(out.logits[0])
    want = naive[len(prompt) :]  # the drafted positions' logits
    assert frob_rel_error(got[0], want) <= MODEL_TOL
    assert frob_rel_error(got[0], got[1]) <= MODEL_TOL / 4
    decoder = fast.decoder
    assert decoder is not None
    rows = cpu_int4.INT4_MAX_ROWS + 1
    cache = fast.new_cache(1, 32, 5)
    state = torch.ones(1, rows, cfg.d_model)
    tokens = torch.ones(1, rows, dtype=torch.long)
    resumed = StepInput(tokens, 5, torch.zeros(1, dtype=torch.long), resume=Resume(state, state, 2))
    assert decoder.decode(resumed, cache) is None
