"""The fused CUDA decode step (run eagerly in the Triton interpreter) equals the naive float64 model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import interpreter_policy, max_rel_error, random_flat_weights
from naive_reference import naive_forward
from tinyloop.config import ArchConfig
from tinyloop.kernels import cuda_ops, gluon_int4_mma
from tinyloop.kernels.cuda_ops import CudaKernels
from tinyloop.kernels.policy import PersistentMlpTile
from tinyloop.model.looped import Resume
from tinyloop.model.weights import ModelWeights
from tinyloop.quant import BlockedInt4Weight, CudaMmaInt4Weight, Int4Weight, quantize_int4
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.fused_decode import FusedDecoder

BASE = dict(
    vocab_size=80, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
    n_prelude=1, n_body=2, n_coda=1, max_position=64,
)  # fmt: skip

VARIANTS = {
    "pre-concat-zeros-gqa": dict(injection="concat", state_start="zeros", head_norm=True),
    "interleaved-qkbias-add": dict(rope_pairing="interleaved", qk_bias=True, injection="add", n_kv_heads=4),
    "huginn-like": dict(
        norm_placement="sandwich_sum", injection="concat", state_start="random", state_init_std=0.6,
        loop_norm="after_loop", head_norm=True, embed_scale=5.0, qk_bias=True, ffn_kind="gelu",
    ),
    "ouro-like": dict(
        norm_placement="sandwich_out", n_prelude=0, n_coda=0, loop_norm="every_loop", head_norm=False,
        tied_embeddings=False, exit_gate=True, injection="none", n_kv_heads=4,
    ),
}  # fmt: skip


def build(
    variant: str, blocked: bool = False, arch: dict[str, object] | None = None, group: int = 64, **policy: object
) -> tuple[ArchConfig, dict[str, torch.Tensor], Engine, Engine]:
    """The same INT4 model twice: packed for the fused kernels (in the CUDA engine's blocked layout with
    `group`-column groups when `blocked`), dequantized for the generic path. `arch` replaces config fields."""
    extra = dict(ffn_dim=128) if blocked else {}
    cfg = ArchConfig(**{**BASE, **VARIANTS[variant], **extra, **(arch or {})})  # type: ignore[arg-type]
    flat = random_flat_weights(cfg, seed=1)
    matrix = ("prelude.", "body.", "coda.", "adapter.", "head.")
    packed = {n: quantize_int4(t, group if blocked else 32) if t.dim() == 2 and n.startswith(matrix) else t
              for n, t in flat.items()}  # fmt: skip
    if blocked:
        packed = {n: BlockedInt4Weight.from_int4(w) if type(w) is Int4Weight else w for n, w in packed.items()}
    dense = {n: w.dequantize() if hasattr(w, "dequantize") else w for n, w in packed.items()}
    cpu = torch.device("cpu")
    kernel_policy = interpreter_policy(**{"blocked_tiles": WIDE_ONE_ROW_TILES, **policy})
    fused = Engine(cfg, ModelWeights.from_flat(cfg, packed), cpu, torch.float32, kernel_policy=kernel_policy)  # type: ignore[arg-type]
    fused.decoder = FusedDecoder(fused, graphs=False)
    generic = Engine(cfg, ModelWeights.from_flat(cfg, dense), cpu, torch.float32)
    generic.decoder = None
    return cfg, dense, fused, generic  # type: ignore[return-value]


# One-row tiles of the blocked GEMV for these small models: 64 rows x 1 block per program. The GPU tiles (4 rows x
# 16 blocks) launch a program per 4 rows, mostly masked at K = 64-128, and the Triton interpreter pays per program:
# a decode step took 51 s with them, 4 s with these. Partial tiles (the 80-row head) remain.
WIDE_ONE_ROW_TILES = {(n, k, 1): (64, 1, 4) for n in range(1, 257) for k in (64, 128)}


@pytest.mark.parametrize("variant", [*sorted(VARIANTS), "blocked:pre-concat-zeros-gqa", "blocked:ouro-like"])
def test_fused_decode_matches_naive(variant: str) -> None:
    blocked = variant.startswith("blocked:")
    cfg, dense, fused, _ = build(variant.removeprefix("blocked:"), blocked)
    loops = 2
    tokens = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    ref_logits, _, ref_gates = naive_forward(cfg, dense, tokens, loops, fused.noise)
    cache = fused.new_cache(1, 16, loops)
    prompt = 5
    fused.step(torch.tensor([tokens[:prompt]]), cache, loops)  # generic prefill: fills the cache
    got = []
    for t in range(prompt, len(tokens)):
        out = fused.step(torch.tensor([[tokens[t]]]), cache, loops, last_only=True)
        got.append(out.logits[0])
        if cfg.exit_gate:
            assert len(out.gates) == loops
            assert (
                max_rel_error(torch.stack([g[0, 0] for g in out.gates]), torch.stack([r[t] for r in ref_gates])) <= 1e-4
            )
    assert int(cache.lengths[0]) == len(tokens)
    assert max_rel_error(torch.cat(got), ref_logits[prompt:]) <= 1e-4


def test_batched_ouro_like_steps_equal_each_row_alone() -> None:
    """Three Ouro-like (sandwich-norm) rows at different lengths in one step (a 3-row blocked GEMV launch) give each
    row's logits from the same step run alone."""
    cfg, _, fused, _ = build("ouro-like", True)
    loops, gen = 2, torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in (5, 3, 7)]
    nxt = torch.randint(0, cfg.vocab_size, (3, 1), generator=gen)
    alone = []
    for i, p in enumerate(prompts):
        cache = fused.new_cache(1, 16, loops)
        fused.step(p, cache, loops)
        alone.append(fused.step(nxt[i : i + 1], cache, loops, last_only=True).logits[0])
    cache = fused.new_cache(3, 16, loops)
    padded = torch.zeros(3, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, : p.shape[1]] = p[0]
    fused.step(padded, cache, loops, valid=torch.tensor([5, 3, 7]))
    together = fused.step(nxt, cache, loops, last_only=True).logits
    for i in range(3):
        assert max_rel_error(together[i], alone[i]) <= 1e-4


def test_one_row_attention_takes_its_long_cache_tile_from_long_cache_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-row decode whose cache grows past long_cache_keys switches to the long tile there (several live splits
    merged), with the naive reference's logits on both sides."""
    cfg, dense, fused, _ = build("pre-concat-zeros-gqa", split_attention_min_head_dim=16, long_cache_keys=7,
                                 one_row_attention_tile=(1, 16, 1), one_row_long_attention_tile=(4, 2, 1))  # fmt: skip
    kernels = fused.decoder.kernels  # type: ignore[union-attr]
    seen: list[bool] = []
    original = kernels.rope_attention

    def recording(qkv: torch.Tensor, *args: object, long_cache: bool = False) -> torch.Tensor:
        seen.append(long_cache)
        return original(qkv, *args, long_cache=long_cache)

    monkeypatch.setattr(kernels, "rope_attention", recording)
    loops = 2
    tokens = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ref_logits, _, _ = naive_forward(cfg, dense, tokens, loops, fused.noise)
    cache = fused.new_cache(1, 16, loops)
    prompt = 5
    fused.step(torch.tensor([tokens[:prompt]]), cache, loops)
    got = [fused.step(torch.tensor([[t]]), cache, loops, last_only=True).logits[0] for t in tokens[prompt:]]
    assert max_rel_error(torch.cat(got), ref_logits[prompt:]) <= 1e-4
    per_step = cfg.n_prelude + cfg.n_coda + cfg.n_body * loops  # attention launches of one step
    assert seen == [False] * per_step + [True] * 3 * per_step  # keys 6, then 7, 8 and 9


def test_fused_batched_multi_token_steps_match_generic() -> None:
    """Two rows at different lengths, steps of 2 tokens, loop count changing between steps."""
    cfg, _, fused, generic = build("pre-concat-zeros-gqa")
    gen = torch.Generator().manual_seed(5)
    caches = [e.new_cache(2, 24, 3) for e in (fused, generic)]
    prompt = torch.randint(0, cfg.vocab_size, (2, 6), generator=gen)
    for eng, cache in zip((fused, generic), caches, strict=True):
        eng.step(prompt, cache, 3, valid=torch.tensor([6, 4]))
    for loops in (3, 2):
        step = torch.randint(0, cfg.vocab_size, (2, 2), generator=gen)
        got, want = (e.step(step, c, loops).logits for e, c in zip((fused, generic), caches, strict=True))
        assert max_rel_error(got, want) <= 1e-4
    assert torch.equal(caches[0].lengths, caches[1].lengths)


@pytest.mark.parametrize("variant", ["interleaved-qkbias-add", "blocked:pre-concat-zeros-gqa"])
def test_fused_prefill_from_empty_cache_matches_generic(variant: str) -> None:
    """A prefill (many rows) multiplies 16-bit copies of the INT4 matrices, made once and kept (the same
    logits as dequantizing before every use), and matches the generic path."""
    cfg, _, fused, generic = build(variant.removeprefix("blocked:"), variant.startswith("blocked:"))
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(9))
    outs = []
    for eng in (fused, generic):
        cache = eng.new_cache(1, 24, 2)
        outs.append(eng.step(tokens, cache, 2).logits)
    assert max_rel_error(outs[0], outs[1]) <= 1e-4
    decoder = fused.decoder
    assert isinstance(decoder, FusedDecoder)
    w = fused.weights
    layers = (*w.prelude, *w.body, *w.coda)
    matrices = [*([] if w.adapter is None else [w.adapter]), *(m for lw in layers for m in lw.matrices()), w.head]
    int4 = [m for m in matrices if isinstance(m, Int4Weight)]
    assert int4 and decoder.dense_copy_bytes == sum(4 * m.shape[0] * m.shape[1] for m in int4)  # float32 copies
    copies = decoder.dense_copies(1, 20)
    batch = fused.kernel_policy.dense_copy_min_rows
    assert all(id(m) in copies for m in int4) and decoder.dense_copies(batch, 1) is copies
    assert decoder.dense_copies(batch - 1, 1) == {} and decoder.dense_copies(1, 1) == {}
    assert decoder.dense_copies(1, fused.kernel_policy.blocked_gemm_max_rows) == {}
    again = fused.step(tokens, fused.new_cache(1, 24, 2), 2).logits
    assert torch.equal(again, outs[0])
    decoder.release()
    decoder.kernels = CudaKernels(dataclasses.replace(decoder.kernels.policy, dense_copy_min_rows=0))
    scratch = fused.step(tokens, fused.new_cache(1, 24, 2), 2).logits
    assert decoder.dense_copy_bytes == 0 and torch.equal(scratch, outs[0])


def test_fused_verification_step_resumes_like_generic() -> None:
    """A speculative verification: tokens rewritten at earlier positions, resumed from drafted states."""
    cfg, _, fused, generic = build("pre-concat-zeros-gqa")
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, cfg.vocab_size, (1, 5), generator=gen)
    drafts = torch.randint(0, cfg.vocab_size, (1, 3), generator=gen)
    outs = []
    for eng in (fused, generic):
        cache = eng.new_cache(1, 16, 3)
        eng.step(prompt, cache, 3)
        states, preludes = [], []
        for i in range(3):  # draft at 1 loop
            d = eng.step(drafts[:, i : i + 1], cache, 1, last_only=True)
            states.append(d.loop_state)
            preludes.append(d.prelude_out)
        resume = Resume(torch.cat(states, dim=1), torch.cat(preludes, dim=1), 1)
        out = eng.step(drafts, cache, 3, start=torch.tensor([5]), resume=resume)
        outs.append(out.logits)
        assert int(cache.lengths[0]) == 8
    assert max_rel_error(outs[0], outs[1]) <= 1e-4


def test_cyclic_gc_paused_restores_the_collector_state() -> None:
    import gc

    from tinyloop.runtime.fused_decode import _cyclic_gc_paused

    assert gc.isenabled()
    with pytest.raises(KeyError), _cyclic_gc_paused():
        assert not gc.isenabled()
        raise KeyError("a capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with _cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left off, as the caller had it
    finally:
        gc.enable()


def test_engine_close_releases_the_decoder_and_later_steps_raise() -> None:
    from tinyloop.errors import ModelClosedError

    cfg, _, fused, _ = build("interleaved-qkbias-add")
    tokens = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    decoder = fused.decoder
    assert isinstance(decoder, FusedDecoder)
    decoder._scratch = fused.new_cache(1, 8, 2)  # what a scoring call leaves behind
    decoder.graph_bytes = 123
    fused.close()
    assert fused.decoder is None and decoder._scratch is None and decoder.graph_bytes == 0
    with pytest.raises(ModelClosedError, match="model was closed"):
        fused.step(tokens, fused.new_cache(1, 8, 2), 2)


@pytest.mark.parametrize("close", [True, False])
def test_engine_close_frees_it_without_the_cyclic_collector(close: bool) -> None:
    import gc
    import weakref

    _, _, fused, generic = build("interleaved-qkbias-add")
    ref = weakref.ref(fused)
    gc.disable()
    try:
        if close:
            fused.close()
        del fused
        assert (ref() is None) == close  # the decoder refers back to its engine: only close() breaks the cycle
    finally:
        gc.enable()
        gc.collect()


def test_batched_steps_that_tinygemm_takes_make_no_16bit_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """From `dense_copy_min_rows` sequences a step multiplies 16-bit copies unless tinygemm takes it (bfloat16 on
    a GPU with `tinygemm` on: 3-8 sequences), so float16 models and GPUs without tinygemm keep the copies."""
    _, _, fused, _ = build("interleaved-qkbias-add")
    decoder = fused.decoder
    assert isinstance(decoder, FusedDecoder)
    policy = fused.kernel_policy
    first, last = policy.dense_copy_min_rows, policy.tinygemm_max_rows
    assert first <= policy.tinygemm_min_rows < last and not decoder._takes_tinygemm(first, 1)  # float32, CPU
    assert decoder.dense_copies(first, 1) and decoder.dense_copies(last, 1)
    decoder.release()
    monkeypatch.setattr(decoder, "_takes_tinygemm", lambda batch, tokens: tokens == 1 and 3 <= batch <= last)
    assert decoder.dense_copies(first, 1) == {} and decoder.dense_copies(last, 1) == {}
    assert decoder.dense_copy_bytes == 0 and decoder._graph_window(last, 1) is None
    assert decoder.dense_copies(last + 1, 1) and decoder.dense_copies(1, 20)


def test_batched_steps_that_the_tensor_core_kernel_takes_use_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of `mma_int4_min_rows` to `mma_int4_max_rows` sequences (16-bit compute, `mma_int4` on) multiply the
    tensor-core INT4 copies of the matrices its tile divides, made once and counted, and make no 16-bit copies;
    a matrix the tile does not divide keeps its INT4 kernels; other row counts are not taken."""
    _, _, fused, _ = build("pre-concat-zeros-gqa", blocked=True)
    decoder = fused.decoder
    assert isinstance(decoder, FusedDecoder)
    lo, hi = 8, 16
    shapes = sorted({tuple(m.shape) for m in decoder._int4_matrices})
    untaken = shapes[-1]
    columns = {shape: 64 if shape != untaken else 192 for shape in shapes}  # 192 divides no row: not taken
    tiles = {(n, k, rows): (1, 1, columns[(n, k)], 16) for n, k in shapes for rows in range(lo, hi + 1)}
    policy = dataclasses.replace(fused.kernel_policy, mma_int4=True, mma_int4_min_rows=lo, mma_int4_max_rows=hi,
                                 mma_int4_tiles=tiles, mma_int4_few_tokens=False)  # fmt: skip
    decoder.kernels = CudaKernels(policy)
    monkeypatch.setattr(decoder.engine, "dtype", torch.bfloat16)
    monkeypatch.setattr(gluon_int4_mma, "available", lambda: True)
    monkeypatch.setattr(decoder, "_tinygemm_fits", True)
    weights = decoder.step_weights(lo, 1)
    taken = [m for m in decoder._int4_matrices if tuple(m.shape) != untaken]
    assert taken and set(weights) == {id(m) for m in taken}
    assert all(isinstance(weights[id(m)], CudaMmaInt4Weight) and weights[id(m)].shape == m.shape for m in taken)
    assert decoder.mma_int4_bytes == sum(w.nbytes for w in decoder._mma_int4.values()) > 0
    assert decoder.dense_copies(lo, 1) == {} and decoder.dense_copy_bytes == 0
    assert decoder.step_weights(hi, 1) == weights and decoder._graph_window(hi, 1) is None
    assert decoder.mma_int4_weights(hi + 1, 1) == {} and decoder.mma_int4_weights(lo - 1, 1) == {}
    assert decoder.mma_int4_weights(lo, 2) == {}  # several tokens a row: only with mma_int4_few_tokens
    decoder.kernels = CudaKernels(dataclasses.replace(policy, mma_int4_few_tokens=True))
    assert decoder.mma_int4_weights(1, lo) == weights and decoder.mma_int4_weights(2, hi // 2) == weights
    assert decoder.mma_int4_weights(1, hi + 1) == {}
    decoder.release()
    assert decoder.mma_int4_bytes == 0


def test_graphs_of_cublas_sized_steps_take_no_l2_window() -> None:
    """Graphs of steps that read the INT4 matrices are captured with the engine's L2 window; graphs of steps
    whose GEMMs go to cuBLAS (batched steps and prefills, reading 16-bit copies) without it, unless cuBLAS is
    off and the INT4 kernels read the body at every row count."""
    from tinyloop.kernels.l2_residency import L2Window

    window = L2Window(4096, 8192, 1.0)
    _, _, fused, _ = build("interleaved-qkbias-add")
    decoder = fused.decoder
    assert isinstance(decoder, FusedDecoder)
    fused.l2_window = window
    assert decoder._graph_window(1, 1) is window and decoder._graph_window(1, 9) is window  # a verification
    assert decoder._graph_window(fused.kernel_policy.dense_copy_min_rows, 1) is None
    _, _, no_copies, _ = build("interleaved-qkbias-add", dense_copy_min_rows=0)
    no_copies.l2_window = window
    assert isinstance(no_copies.decoder, FusedDecoder)
    largest_int4_step = no_copies.kernel_policy.blocked_gemm_max_rows
    assert no_copies.decoder._graph_window(1, largest_int4_step) is window
    assert no_copies.decoder._graph_window(1, largest_int4_step + 1) is None
    _, _, no_cublas, _ = build("interleaved-qkbias-add", cublas_16bit=False)
    no_cublas.l2_window = window
    assert isinstance(no_cublas.decoder, FusedDecoder) and no_cublas.decoder._graph_window(1, 1024) is window


@pytest.mark.parametrize("mode", ["given up", "switched off", "driver error", "no window"])
def test_persisting_share_given_up_during_prefills(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With SHARE_OFF_DURING_PREFILL, a prefill-sized step gives the persisting L2 share up, once until a
    windowed graph takes it back; a failing driver call is said and the step still runs; an engine without a
    window leaves the context's share alone."""
    from tinyloop.kernels import l2_residency
    from tinyloop.kernels.l2_residency import L2Window

    cfg, _, fused, generic = build("interleaved-qkbias-add")
    decoder = fused.decoder
    assert isinstance(decoder, FusedDecoder)
    if mode != "no window":
        fused.l2_window = L2Window(4096, 8192, 0.5)
    calls: list[str] = []

    def drop() -> None:
        calls.append("drop")
        if mode == "driver error":
            raise l2_residency.DriverError("cuCtxSetLimit returned CUresult 1")

    said: list[str] = []
    monkeypatch.setattr(l2_residency, "drop_persisting_share", drop)
    monkeypatch.setattr(l2_residency, "set_persisting_limit", lambda n: calls.append(f"set {n}"))
    monkeypatch.setattr(l2_residency, "SHARE_OFF_DURING_PREFILL", mode != "switched off")
    monkeypatch.setattr("tinyloop.runtime.fused_decode.info", said.append)
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        got = fused.step(tokens, fused.new_cache(1, 24, 2), 2).logits
    want = generic.step(tokens, generic.new_cache(1, 24, 2), 2).logits
    assert max_rel_error(got, want) <= 1e-4
    dropped = mode in ("given up", "driver error")
    assert calls == (["drop"] if dropped else [])  # once for both prefills
    assert decoder._share_dropped == dropped
    error = "L2 residency: the persisting share is kept during a prefill (cuCtxSetLimit returned CUresult 1)"
    assert [ln for ln in said if "persisting share" in ln] == ([error] if mode == "driver error" else [])
    if dropped:  # what a windowed graph's replay does first (graphs need CUDA)
        decoder._restore_share()
        assert calls == ["drop", "set 4096"] and not decoder._share_dropped


def test_fused_decoder_launches_with_its_engines_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, fused, _ = build("interleaved-qkbias-add", rope_block_rows=8)
    policy = fused.kernel_policy
    seen: list[object] = []
    for name in ("fused_linear", "rms_norm", "add", "rope_attention", "rope_store", "cached_attention"):
        launcher = getattr(cuda_ops, name)
        monkeypatch.setattr(cuda_ops, name, lambda p, *a, _f=launcher, **k: seen.append(p) or _f(p, *a, **k))
    cache = fused.new_cache(1, 8, 2)
    fused.step(torch.tensor([[1, 2, 3]]), cache, 2)  # a fused prefill: RoPE + cache write, cached attention
    fused.step(torch.tensor([[4]]), cache, 2, last_only=True)
    assert seen and all(p is policy for p in seen)
    assert policy.rope_block_rows == 8


# One program per launch for the models below (the interpreter pays per program and per operation, not per byte):
# the blocked GEMVs over whole matrices, the persistent MLP as one gate / up item and one down item per layer.
WHOLE_MATRIX_TILES = {(n, k, r): (256, 2, 4) for n in range(1, 257) for k in (64, 128) for r in range(1, 5)}
ONE_ITEM_MLP = {(64, 128, r): PersistentMlpTile(128, 1, 128, 64, 4) for r in range(1, 5)}


def _test_tiny(**policy: object) -> Engine:
    """The test-tiny preset in INT4 (groups of 32, as its files are written) in the CUDA engine's blocked layout."""
    from tinyloop.presets import preset

    cfg = preset("test-tiny")
    flat = random_flat_weights(cfg, seed=7)
    matrix = ("prelude.", "body.", "coda.", "adapter.", "head.")
    packed = {n: BlockedInt4Weight.from_int4(quantize_int4(t, 32)) if t.dim() == 2 and n.startswith(matrix) else t
              for n, t in flat.items()}  # fmt: skip
    engine = Engine(cfg, ModelWeights.from_flat(cfg, packed), torch.device("cpu"), torch.float32,  # type: ignore[arg-type]
                    kernel_policy=interpreter_policy(**policy))  # fmt: skip
    engine.decoder = FusedDecoder(engine, graphs=False)
    return engine


@pytest.mark.parametrize("model", ["test-tiny", "blocked:ouro-like"])
def test_persistent_mlp_decodes_the_default_paths_greedy_tokens(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the policy's persistent_decode (TINYLOOP_PERSISTENT_DECODE=1) the MLP sublayer of every step of 1-4
    rows is one persistent launch (pre-norm: into the residual; sandwich norms: before the post-norm), and greedy
    decoding gives the default path's tokens with its logits."""
    from tinyloop.kernels import persistent_mlp

    launches: list[int] = []
    launcher = persistent_mlp.persistent_mlp
    monkeypatch.setattr(persistent_mlp, "persistent_mlp", lambda *a, **k: launches.append(1) or launcher(*a, **k))
    tiles = dict(blocked_tiles=WHOLE_MATRIX_TILES, persistent_mlp_tiles=ONE_ITEM_MLP)
    if model == "test-tiny":
        default, persistent = _test_tiny(**tiles), _test_tiny(persistent_decode=True, **tiles)
    else:
        default, persistent = (build("ouro-like", True, persistent_decode=on, **tiles)[2] for on in (False, True))
    cfg, loops, steps = default.cfg, 2, 3
    prompt = torch.randint(0, cfg.vocab_size, (1, 2), generator=torch.Generator().manual_seed(6))
    tokens, logits = [], []
    for eng in (default, persistent):
        cache = eng.new_cache(1, 8, loops)
        out = eng.step(prompt, cache, loops, last_only=True)
        seq, steps_logits = [int(out.logits[0, -1].argmax())], [out.logits[0, -1]]
        for _ in range(steps):
            out = eng.step(torch.tensor([[seq[-1]]]), cache, loops, last_only=True)
            steps_logits.append(out.logits[0, -1])
            seq.append(int(out.logits[0, -1].argmax()))
        tokens.append(seq)
        logits.append(torch.stack(steps_logits))
    assert tokens[0] == tokens[1]
    assert max_rel_error(logits[1], logits[0]) <= 1e-5
    layers = cfg.n_prelude + loops * cfg.n_body + cfg.n_coda
    assert len(launches) == (1 + steps) * layers  # the 2-token prompt is decode-sized too


def test_attention_out_decodes_like_the_naive_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """With attention_out_max_rows on, every one-token step's attention and output projection is one launch (here
    pre-norm, with the residual, and grouped heads), and one row from an empty cache, then two rows, decode with
    the naive float64 reference's logits and greedy tokens. (The kernel's own tests cover partial output tiles,
    several blocks a head and no residual; the interpreter pays per program, so this model keeps them few.)"""
    from tinyloop.kernels import attention_out

    launches: list[int] = []
    launcher = attention_out.attention_out
    monkeypatch.setattr(attention_out, "attention_out", lambda *a, **k: launches.append(1) or launcher(*a, **k))
    cfg, dense, fused, _ = build("pre-concat-zeros-gqa", True, arch=dict(head_dim=32), group=32,
                                 attention_out_max_rows=2, attention_out_tile=(16, 64, 1))  # fmt: skip
    loops = 2
    tokens = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(8))
    ref = [naive_forward(cfg, dense, row.tolist(), loops, fused.noise)[0] for row in tokens]
    cache = fused.new_cache(1, 8, loops)
    got = torch.cat([fused.step(tokens[:1, t : t + 1], cache, loops, last_only=True).logits[0] for t in range(3)])
    assert max_rel_error(got, ref[0]) <= 1e-4
    assert torch.equal(got.argmax(-1), ref[0].argmax(-1))
    pair = fused.new_cache(2, 8, loops)
    both = fused.step(tokens[:, :1], pair, loops, last_only=True).logits[:, 0]
    assert max_rel_error(both, torch.stack([r[0] for r in ref])) <= 1e-4
    layers = cfg.n_prelude + loops * cfg.n_body + cfg.n_coda
    assert len(launches) == 4 * layers  # three one-row steps and one two-row step
