"""The CPU decode path (runtime/cpu_decode.py) equals the generic forward and the naive float64 reference."""

from __future__ import annotations

import pytest
import torch
from test_cached_vs_naive import BASE, VARIANTS

from helpers import max_rel_error, random_flat_weights
from naive_reference import naive_forward
from tinyloop.cache.dense import DenseKVCache
from tinyloop.cache.kv import KVCache
from tinyloop.config import ArchConfig
from tinyloop.kernels import cpu_onednn
from tinyloop.model.looped import ForwardOutput, Resume
from tinyloop.model.weights import ModelWeights
from tinyloop.quant import quantize_int4
from tinyloop.runtime import cpu_decode
from tinyloop.runtime import engine as engine_module
from tinyloop.runtime.cpu_decode import CpuDecoder
from tinyloop.runtime.decode_path import StepInput
from tinyloop.runtime.engine import Engine

TOL = 1e-5


def fast_step(
    fast: Engine, tokens: torch.Tensor, cache: KVCache, loops: int, last_only: bool = True, **step: object
) -> ForwardOutput:
    """fast.step, failing if the step fell back to the generic forward."""

    def refuse(*args: object, **kwargs: object) -> ForwardOutput:
        raise AssertionError("the CPU decoder declined a plain decode step")

    generic_forward = engine_module.forward
    engine_module.forward = refuse  # type: ignore[assignment]
    try:
        return fast.step(tokens, cache, loops, last_only=last_only, **step)  # type: ignore[arg-type]
    finally:
        engine_module.forward = generic_forward


def engines(variant: str, **changes: object) -> tuple[ArchConfig, dict[str, torch.Tensor], Engine, Engine]:
    """The same model twice: with the CPU decoder, and with the generic forward only."""
    cfg = ArchConfig(**{**BASE, **VARIANTS[variant], **changes})  # type: ignore[arg-type]
    flat = random_flat_weights(cfg, seed=3)
    fast = Engine(cfg, ModelWeights.from_flat(cfg, flat), torch.device("cpu"), torch.float32)
    generic = Engine(cfg, ModelWeights.from_flat(cfg, flat), torch.device("cpu"), torch.float32)
    generic.decoder = None
    assert isinstance(fast.decoder, CpuDecoder)
    return cfg, flat, fast, generic


def decode_both(fast: Engine, generic: Engine, caches: tuple[KVCache, KVCache], token_rows: list[list[int]],
                loops: list[int]) -> list[torch.Tensor]:  # fmt: skip
    """Decode each column of token_rows as one step on both engines; check every output; fast logits."""
    out = []
    for step, n_loops in enumerate(loops):
        tokens = torch.tensor([[row[step]] for row in token_rows])
        a = fast_step(fast, tokens, caches[0], n_loops)
        b = generic.step(tokens, caches[1], n_loops, last_only=True)
        assert a.logits is not None and b.logits is not None and a.logits.shape == b.logits.shape
        assert max_rel_error(a.logits, b.logits) <= TOL, f"step {step}: logits"
        assert a.loop_state is not None and b.loop_state is not None and a.prelude_out is not None
        assert max_rel_error(a.loop_state, b.loop_state) <= TOL
        assert b.prelude_out is not None and max_rel_error(a.prelude_out, b.prelude_out) <= TOL
        assert len(a.gates) == len(b.gates)
        for g, h in zip(a.gates, b.gates, strict=True):
            assert g.shape == h.shape and max_rel_error(g, h) <= TOL
        assert torch.equal(caches[0].lengths, caches[1].lengths)
        out.append(a.logits)
    used = caches[0].cfg.n_cache_slots(max(loops))
    for name in ("k", "v"):  # the K/V the fast path wrote are the generic path's
        got, ref = getattr(caches[0], name)[:used], getattr(caches[1], name)[:used]
        assert max_rel_error(got, ref) <= TOL, name
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("loops", [1, 3])
def test_decode_matches_generic_and_naive(variant: str, loops: int) -> None:
    cfg, flat, fast, generic = engines(variant)
    tokens = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(loops)).tolist()
    prompt = 4
    caches = (fast.new_cache(1, 40, loops), generic.new_cache(1, 40, loops))
    for engine, cache in zip((fast, generic), caches, strict=True):
        engine.step(torch.tensor([tokens[:prompt]]), cache, loops)
    got = decode_both(fast, generic, caches, [tokens[prompt:]], [loops] * (len(tokens) - prompt))
    ref, _, _ = naive_forward(cfg, flat, tokens, loops, fast.noise)
    err = max_rel_error(torch.cat([g[0] for g in got]), ref[prompt:])
    assert err <= TOL, f"{variant} loops={loops}: max relative error {err:.2e} against the naive reference"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_matches_generic_and_naive(variant: str) -> None:
    """One row's prompt in two pieces (the second after what the cache holds): every position's logits and
    the K/V written, then the last position alone (last_only) as the decode loop asks for it."""
    cfg, flat, fast, generic = engines(variant)
    loops = 3
    tokens = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(7)).tolist()
    caches = (fast.new_cache(1, 40, loops), generic.new_cache(1, 40, loops))
    pieces = (tokens[:13], tokens[13:])
    got = [fast_step(fast, torch.tensor([p]), caches[0], loops, last_only=False).logits for p in pieces]
    ref = [generic.step(torch.tensor([p]), caches[1], loops).logits for p in pieces]
    assert all(g is not None and r is not None and g.shape == r.shape for g, r in zip(got, ref, strict=True))
    fast_logits, generic_logits = torch.cat(got, dim=1)[0], torch.cat(ref, dim=1)[0]  # type: ignore[arg-type]
    assert max_rel_error(fast_logits, generic_logits) <= TOL
    naive, _, _ = naive_forward(cfg, flat, tokens, loops, fast.noise)
    assert max_rel_error(fast_logits, naive) <= TOL
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    used = cfg.n_cache_slots(loops)
    for name in ("k", "v"):
        assert max_rel_error(getattr(caches[0], name)[:used], getattr(caches[1], name)[:used]) <= TOL, name
    caches[0].truncate(0)
    last = fast_step(fast, torch.tensor([tokens]), caches[0], loops).logits
    assert last is not None and last.shape == (1, 1, cfg.vocab_size)
    assert max_rel_error(last[0, 0], naive[-1]) <= TOL


def draft_then_verify(
    engine: Engine, prompt: list[int], drafts: list[int], fast: bool
) -> tuple[ForwardOutput, KVCache]:
    """Self-speculation's verify pass on a fresh cache: the prompt at 5 loops, the drafts appended one at a time at
    2 loops, then the drafted positions recomputed from their drafted states (start_loop 2) to 5 loops; `fast`
    fails if the CPU decoder declines the pass."""
    cache = engine.new_cache(1, 32, 5)
    engine.step(torch.tensor([prompt]), cache, 5, last_only=True)
    shallow = [engine.step(torch.tensor([[t]]), cache, 2, last_only=True) for t in drafts]
    state, prelude = (torch.cat([getattr(o, name) for o in shallow], dim=1) for name in ("loop_state", "prelude_out"))
    step = dict(start=torch.tensor([len(prompt)]), resume=Resume(state, prelude, 2))
    if fast:
        return fast_step(engine, torch.tensor([drafts]), cache, 5, last_only=False, **step), cache
    return engine.step(torch.tensor([drafts]), cache, 5, **step), cache  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", ["pre-concat-zeros-gqa", "pre-add-prelude", "huginn-like", "ouro-like"])
def test_verification_resumed_over_drafted_positions_matches_generic_and_naive(variant: str) -> None:
    """Self-speculation's verify pass: drafts appended at 2 loops, then the same positions recomputed from
    their drafted state (start_loop 2) to 5 loops, rewriting the deeper slots; equals the generic path, and the
    next token equals the naive reference of the whole sequence at 5 loops."""
    cfg, flat, fast, generic = engines(variant)
    prompt, drafts = [5, 9, 2, 7, 1, 3], [11, 12, 13, 14]
    (got, fast_cache), (ref, generic_cache) = (draft_then_verify(e, prompt, drafts, e is fast) for e in (fast, generic))
    caches = (fast_cache, generic_cache)
    assert got.logits is not None and ref.logits is not None and got.logits.shape == ref.logits.shape
    assert max_rel_error(got.logits, ref.logits) <= TOL
    assert got.loop_state is not None and ref.loop_state is not None
    assert max_rel_error(got.loop_state, ref.loop_state) <= TOL
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    used = cfg.n_cache_slots(5)
    for name in ("k", "v"):
        assert max_rel_error(getattr(caches[0], name)[:used], getattr(caches[1], name)[:used]) <= TOL, name
    naive, _, _ = naive_forward(cfg, flat, prompt + drafts + [17], 5, fast.noise)
    assert max_rel_error(got.logits[0], naive[len(prompt) : len(prompt) + len(drafts)]) <= TOL
    following = fast_step(fast, torch.tensor([[17]]), caches[0], 5).logits
    assert following is not None and max_rel_error(following[0, 0], naive[-1]) <= TOL


@pytest.mark.parametrize("variant", ["pre-concat-zeros-gqa", "huginn-like"])
def test_torch_mm_products_match_generic(variant: str) -> None:
    """The decoder without oneDNN (torch.mm on the loader's layout) prefills and decodes as the generic path."""
    cfg, _, fast, generic = engines(variant)
    fast.decoder = CpuDecoder(cfg, fast.weights, fast.cos, fast.sin, fast.noise, onednn=False)
    assert not fast.decoder.onednn and not any(
        isinstance(m, cpu_onednn.OneDnnMatrix) for m in fast.decoder.operands.values()
    )
    caches = (fast.new_cache(2, 32, 3), generic.new_cache(2, 32, 3))
    for engine, cache in zip((fast, generic), caches, strict=True):
        engine.step(torch.tensor([[5, 9, 2], [4, 8, 6]]), cache, 3)
    decode_both(fast, generic, caches, [[11, 12, 13], [21, 22, 23]], [3, 3, 3])
    one = (fast.new_cache(1, 32, 3), generic.new_cache(1, 32, 3))
    got = fast_step(fast, torch.tensor([[5, 9, 2, 7, 1, 3]]), one[0], 3, last_only=False).logits
    ref = generic.step(torch.tensor([[5, 9, 2, 7, 1, 3]]), one[1], 3).logits
    assert got is not None and ref is not None and max_rel_error(got, ref) <= TOL


@pytest.mark.parametrize("variant", ["pre-concat-zeros-gqa", "huginn-like", "ouro-like", "layernorm-gelu-untied"])
def test_ragged_batch_matches_naive_per_row(variant: str) -> None:
    cfg, flat, fast, generic = engines(variant)
    prompts = [[5, 9, 2, 7, 1, 3], [4, 8], [6, 6, 6, 1]]
    nexts = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    loops = 3
    caches = (fast.new_cache(3, 32, loops), generic.new_cache(3, 32, loops))
    width = max(len(p) for p in prompts)
    batch = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    valid = torch.tensor([len(p) for p in prompts])
    for engine, cache in zip((fast, generic), caches, strict=True):
        engine.step(batch, cache, loops, valid=valid, last_only=True)
    got = decode_both(fast, generic, caches, nexts, [loops] * 4)
    for b, (p, n) in enumerate(zip(prompts, nexts, strict=True)):
        ref, _, _ = naive_forward(cfg, flat, p + n, loops, fast.noise)
        assert max_rel_error(torch.stack([g[b, 0] for g in got]), ref[len(p) :]) <= TOL, f"row {b}"


def test_uniform_batch_and_loops_changing_between_steps() -> None:
    _, _, fast, generic = engines("pre-concat-zeros-gqa")
    caches = (fast.new_cache(2, 32, 6), generic.new_cache(2, 32, 6))
    for engine, cache in zip((fast, generic), caches, strict=True):
        engine.step(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache, 6)
    decode_both(fast, generic, caches, [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]], [6, 2, 5, 1, 6])


def test_attended_span_grows_across_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-cache views are rebuilt when the span grows past a bucket, capped at the cache's max_seq."""
    monkeypatch.setattr(cpu_decode, "SPAN_BUCKET", 4)
    cfg, flat, fast, generic = engines("huginn-like")
    tokens = list(range(1, 20))
    caches = (fast.new_cache(1, 19, 2), generic.new_cache(1, 19, 2))
    for engine, cache in zip((fast, generic), caches, strict=True):
        engine.step(torch.tensor([tokens[:2]]), cache, 2)
    got = decode_both(fast, generic, caches, [tokens[2:]], [2] * (len(tokens) - 2))
    ref, _, _ = naive_forward(cfg, flat, tokens, 2, fast.noise)
    assert max_rel_error(torch.cat([g[0] for g in got]), ref[2:]) <= TOL


def test_truncated_cache_and_a_second_cache_reuse_nothing_stale() -> None:
    cfg, flat, fast, _ = engines("pre-add-prelude")
    cache = fast.new_cache(1, 32, 2)
    fast.step(torch.tensor([[1, 2, 3, 4]]), cache, 2)
    for t in (50, 51, 52):
        fast.step(torch.tensor([[t]]), cache, 2)
    cache.truncate(4)
    out = fast.step(torch.tensor([[7]]), cache, 2, last_only=True)
    other = fast.new_cache(1, 32, 2)
    fast.step(torch.tensor([[1, 2, 3, 4]]), other, 2)
    again = fast.step(torch.tensor([[7]]), other, 2, last_only=True)
    ref, _, _ = naive_forward(cfg, flat, [1, 2, 3, 4, 7], 2)
    assert out.logits is not None and again.logits is not None
    assert max_rel_error(out.logits[0, 0], ref[-1]) <= TOL
    assert torch.equal(out.logits, again.logits)


def test_declines_what_it_does_not_handle() -> None:
    cfg, _, fast, _ = engines("pre-add-prelude")
    decoder = fast.decoder
    assert decoder is not None
    cache = fast.new_cache(2, 16, 2)
    at_end = torch.zeros(2, dtype=torch.long)

    def step(
        tokens: list[list[int]] | torch.Tensor,
        start: torch.Tensor,
        valid: torch.Tensor | None = None,
        resume: Resume | None = None,
    ) -> StepInput:
        return StepInput(torch.as_tensor(tokens), 2, start, valid, True, resume)

    assert decoder.decode(step([[1, 2], [3, 4]], at_end), cache) is None  # 2 tokens
    long_prompt = torch.ones(1, cpu_decode.PREFILL_MAX_TOKENS + 1, dtype=torch.long)
    assert decoder.decode(step(long_prompt, at_end[:1]), fast.new_cache(1, 300, 2)) is None
    assert decoder.decode(step([[1], [2]], at_end, valid=torch.tensor([1, 0])), cache) is None
    assert decoder.decode(step([[1]], at_end[:1]), cache) is None  # batch differs
    one = fast.new_cache(1, 16, 2)
    assert decoder.decode(step([[1, 2]], torch.tensor([3])), one) is None  # a gap
    state = torch.ones(2, 1, cfg.d_model)
    resumed_rows = decoder.decode(step([[1], [2]], at_end, resume=Resume(state, state, 1)), cache)
    assert resumed_rows is None  # resumed forwards: one row only
    narrow = DenseKVCache(cfg, 1, 16, 2, "cpu", torch.float32, storage_dtype=torch.float16)
    out = fast.step(torch.tensor([[1, 2, 3]]), narrow, 2)  # a float16 cache runs the generic path
    assert out.logits is not None and int(narrow.lengths[0]) == 3


def test_selected_only_for_float32_dense_cpu() -> None:
    cfg = ArchConfig(**{**BASE, **VARIANTS["pre-add-prelude"]})  # type: ignore[arg-type]
    flat = random_flat_weights(cfg, seed=1)
    assert Engine(cfg, ModelWeights.from_flat(cfg, flat), torch.device("cpu"), torch.bfloat16).decoder is None
    quantized = dict(flat, **{"body.0.attn.qkv.weight": quantize_int4(flat["body.0.attn.qkv.weight"], 32)})
    assert Engine(cfg, ModelWeights.from_flat(cfg, quantized), torch.device("cpu"), torch.float32).decoder is None


def test_builtin_model_decodes_as_the_generic_path() -> None:
    from tinyloop.builtin import resolve_model
    from tinyloop.runtime.loader import load_engine

    _, fast = load_engine(resolve_model("tiny"), torch.device("cpu"))
    generic = Engine(fast.cfg, fast.weights, fast.device, fast.dtype)
    generic.decoder = None
    prompt = torch.tensor([list(b"def fibonacci(n):")])
    caches = (fast.new_cache(1, 40, 8), generic.new_cache(1, 40, 8))
    out = fast.step(prompt, caches[0], 8, last_only=True)
    generic.step(prompt, caches[1], 8, last_only=True)
    assert out.logits is not None
    greedy, token = [], int(out.logits[0, -1].argmax())
    for _ in range(6):
        logits = decode_both(fast, generic, caches, [[token]], [8])[0]
        token = int(logits[0, -1].argmax())
        greedy.append(token)
    assert len(greedy) == 6


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("shape", [(96, 256), (256, 128)])
def test_cpu_int4_dequantization_is_bit_exact(group_size: int, shape: tuple[int, int]) -> None:
    from tinyloop.runtime.loader import dequantize_int4_cpu

    w = quantize_int4(torch.randn(shape, generator=torch.Generator().manual_seed(group_size)), group_size)
    got = dequantize_int4_cpu(w)
    assert got.shape == shape and torch.equal(got, w.dequantize(torch.float32))
    out_f, in_f = shape
    assert got.t().is_contiguous() if out_f >= in_f else got.is_contiguous()  # the faster layout for one row


@pytest.mark.parametrize("shape", [(96, 64), (384, 1024), (1152, 384)])
def test_onednn_product_of_a_row_does_not_depend_on_the_other_rows(shape: tuple[int, int]) -> None:
    """What batched == alone rests on in the CPU decode step: row r of a product is the same for 1 row and 16."""
    assert cpu_onednn.available()
    gen = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=gen)
    x = torch.randn(16, shape[1], generator=gen)
    packed = cpu_onednn.pack(w)
    full = cpu_onednn.matmul(x, packed)
    assert max_rel_error(full, x.double() @ w.double().T) <= 1e-6
    for r in range(16):
        assert torch.equal(cpu_onednn.matmul(x[r : r + 1], packed), full[r : r + 1]), r
    assert torch.equal(cpu_onednn.matmul(x[:8], packed), full[:8])
    plus = torch.randn(16, shape[0], generator=gen)
    assert torch.equal(cpu_onednn.matmul_add(x[3:4], packed, plus[3:4]), cpu_onednn.matmul_add(x, packed, plus)[3:4])
