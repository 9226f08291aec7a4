"""Everything issue 4 (and the GPU rows of issues 7 and 9) measure, in one device call.

    PYTHONPATH=src python3 bench/gpu_suite.py --out $OUT/gpu_suite.json [--only SECTION ...]

Sections: env (versions, copy bandwidth), correctness (GPU vs CPU float32 for the built-in model and
seed-407m: prefill, graph-captured decode, fp16 body, attention switches, greedy agreement), sweep
(INT4 matvec tile sizes per seed-407m shape, tensor-core tiles vs cuBLAS per row count; the winners are
applied to the later sections), seed407m (decode 128 after 128, prefill 128/1024, decode vs loops,
fp16 body, speculative), ouro (Ouro-1.4B shape, INT4), stochastic (issue 9 kernels, when present).
Every section saves the JSON so far; a failing section records its traceback and the rest still run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tinyloop
from tinyloop.kernels import cuda_ops
from tinyloop.quant import BlockedInt4Weight, Int4Weight, quantize_int4

RESULTS: dict[str, Any] = {"errors": {}}
OUT = Path("gpu_suite.json")
SEED_PATH = "/tmp/seed-407m.tinyloop"
OURO_PATH = "/tmp/ouro-1.4b-shape.tinyloop"


def save() -> None:
    OUT.write_text(json.dumps(RESULTS, indent=1, default=float))


def section(name: str, fn: Callable[[], Any]) -> None:
    t = time.perf_counter()
    print(f"=== {name}", flush=True)
    try:
        RESULTS[name] = fn()
    except Exception:
        RESULTS["errors"][name] = traceback.format_exc()
        print(RESULTS["errors"][name], flush=True)
    RESULTS.setdefault("section_s", {})[name] = time.perf_counter() - t
    print(f"=== {name} done in {time.perf_counter() - t:.1f} s: {json.dumps(RESULTS.get(name), default=float)[:3000]}")
    save()


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def rel(a: Any, b: Any) -> float:
    a, b = torch.as_tensor(np.asarray(a), dtype=torch.float64), torch.as_tensor(np.asarray(b), dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def with_env(env: dict[str, str], fn: Callable[[], Any]) -> Any:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- env ------------------------------------------------------------------------------------------
def env_section() -> dict[str, Any]:
    import triton

    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    t = statistics.median(timed(lambda: y.copy_(x), 10))
    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "sm_count": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "copy_bandwidth_TBps": 2 * x.numel() / t / 1e12,
    }


# ---- correctness ----------------------------------------------------------------------------------
def teacher_forced_decode(model: Any, ids: np.ndarray, prompt: int, steps: int, loops: int) -> np.ndarray:
    eng = model._engine
    cache = eng.new_cache(1, prompt + steps + 1, loops)
    eng.step(torch.as_tensor(ids[None, :prompt], dtype=torch.long), cache, loops, last_only=True)
    out = []
    for t in range(prompt, prompt + steps):
        step = eng.step(torch.as_tensor([[int(ids[t])]]), cache, loops, last_only=True)
        out.append(step.logits[0, -1].float().cpu().numpy())
    return np.stack(out)


def compare_model(path: str, ids: np.ndarray, loops: int, greedy_prompts: list[np.ndarray], **gpu_kw: Any) -> dict:
    cpu = tinyloop.Model(path, max_seq_len=512, device="cpu")
    gpu = tinyloop.Model(path, max_seq_len=512, device="cuda", **gpu_kw)
    res: dict[str, Any] = {}
    res["prefill_rel_frob"] = rel(gpu.score(ids, loops=loops), cpu.score(ids, loops=loops))
    res["short_prefill_rel_frob"] = rel(gpu.score(ids[:12], loops=loops), cpu.score(ids[:12], loops=loops))
    c = teacher_forced_decode(cpu, ids, 64, 24, loops)
    g = teacher_forced_decode(gpu, ids, 64, 24, loops)
    res["graph_decode_rel_frob"] = rel(g, c)
    res["graph_decode_argmax_agree"] = float((g.argmax(-1) == c.argmax(-1)).mean())
    agree = []
    for p in greedy_prompts:
        a = cpu.generate(p, 32, loops=loops, temperature=0.0)
        b = gpu.generate(p, 32, loops=loops, temperature=0.0)
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        agree.append(n)
    res["greedy_first_tokens_agreeing"] = agree
    res["vram_usage_mb"] = gpu.vram_usage_mb()
    res["torch_memory_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
    gpu.close()
    cpu.close()
    torch.cuda.empty_cache()
    return res


def correctness_section() -> dict[str, Any]:
    import inspect
    import json as json_mod

    text = inspect.getsource(json_mod.decoder).encode()[:400]
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
    starts = ("def fibonacci(n):", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self")
    prompts = [np.frombuffer(p.encode(), dtype=np.uint8).astype(np.int32) for p in starts]
    res: dict[str, Any] = {}
    res["tiny_default_dtype"] = compare_model("tiny", ids, 8, prompts)
    res["tiny_bf16"] = compare_model("tiny", ids, 8, prompts, dtype=torch.bfloat16)
    res["tiny_fp16_body"] = with_env(
        {"TINYLOOP_EXPERIMENTAL_FP16_BODY": "1"}, lambda: compare_model("tiny", ids, 8, prompts)
    )
    res["tiny_fp16_body_no_cublas"] = with_env(
        {"TINYLOOP_EXPERIMENTAL_FP16_BODY": "1", "TINYLOOP_DISABLE_CUBLAS_FP16": "1"},
        lambda: compare_model("tiny", ids, 8, prompts[:1]),
    )
    res["tiny_no_flash"] = with_env(
        {"TINYLOOP_DISABLE_FLASH2_PREFILL": "1"}, lambda: compare_model("tiny", ids, 8, prompts[:1])
    )
    res["tiny_cudnn"] = with_env({"TINYLOOP_USE_CUDNN_SDPA": "1"}, lambda: compare_model("tiny", ids, 8, prompts[:1]))
    wait_for_models(SEED_PATH)
    rng = np.random.default_rng(0)
    sid = rng.integers(0, 32000, 160).astype(np.int32)
    res["seed407m_bf16"] = compare_model(SEED_PATH, sid, 8, [sid[:16]])
    res["seed407m_f32"] = compare_model(SEED_PATH, sid, 8, [sid[:16]], dtype=torch.float32)
    return res


# ---- sweep ----------------------------------------------------------------------------------------
def graph_time(fn: Callable[[], Any], calls: int, repeat: int = 20) -> float:
    """Seconds per call of `fn` when `calls` of them run back to back inside one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    t = statistics.median(timed(g.replay, repeat))
    return t / calls


SEED_SHAPES = {  # name: (N, K, act); swiglu reads 2N rows
    "qkv": (6144, 2048, 0), "out": (2048, 2048, 0), "gate_up": (5632, 2048, 1), "down": (2048, 5632, 0),
    "head": (32000, 2048, 0),
}  # fmt: skip
# (BLOCK_N, BLOCK_B, warps); BLOCK_B 32-64: a whole 2048-column row slice in one tile, all fetched before the PDL wait
GEMV_CANDIDATES = [(4, 16, 4), (4, 8, 2), (2, 16, 2), (8, 16, 4), (2, 8, 1), (8, 8, 4),
                   (4, 32, 4), (4, 32, 8), (2, 32, 2), (2, 32, 4), (8, 32, 8), (16, 32, 8), (4, 64, 8)]  # fmt: skip


def random_int4_copies(n_rows: int, k: int, gen: torch.Generator, group: int = 64) -> list[BlockedInt4Weight]:
    """Enough distinct random INT4 matrices (blocked layout) that cycling through them streams from DRAM,
    not the 60 MiB L2."""
    copies = max(2, min(24, int(600e6 // (n_rows * k // 2))))
    return [BlockedInt4Weight(torch.randint(0, 256, (n_rows, k // 2), dtype=torch.uint8, device="cuda", generator=gen),
                              (torch.rand(n_rows, k // group, device="cuda", generator=gen) * 0.01).half(),
                              (torch.rand(n_rows, k // group, device="cuda", generator=gen) * -0.05).half(), group)
            for _ in range(copies)]  # fmt: skip


def time_cycling(x: torch.Tensor, ws: list[BlockedInt4Weight], act: int) -> dict[str, float]:
    """fused_linear over the copies back to back in one CUDA graph: µs per call and GB/s of weight bytes."""
    it = iter(range(10**9))
    t = graph_time(lambda: cuda_ops.fused_linear(x, ws[next(it) % len(ws)], act=act), len(ws) * 2)
    return {"us": t * 1e6, "GBps": ws[0].nbytes / t / 1e9}


FULL = True  # quick_correctness also runs seed-407m on the CPU (about a minute)
MATMUL_SWEEP = False  # tensor-core tiles vs cuBLAS: measured once (docs/BENCHMARKS.md), cuBLAS won


def quick_correctness_section() -> dict[str, Any]:
    """The kernels' agreement with the CPU after a kernel change: built-in model, seed-407m in float32."""
    wait_for_models(SEED_PATH)
    prompts = [np.frombuffer(p.encode(), dtype=np.uint8).astype(np.int32) for p in ("def f(", "class Stack:\n  ")]
    ids = np.frombuffer(b"import os\n" * 30, dtype=np.uint8).astype(np.int32)
    sid = np.random.default_rng(0).integers(0, 32000, 120).astype(np.int32)
    kernels = {}
    gen = torch.Generator().manual_seed(0)
    for rows, group in ((1, 64), (2, 64), (4, 64), (1, 32), (3, 128), (5, 64), (8, 64), (12, 64)):
        raw = torch.randn(2 * 1536, 2048, generator=gen) / 45
        q = quantize_int4(raw, group).to("cuda")
        x = torch.randn(rows, 2048, generator=gen)
        nw = 1 + 0.1 * torch.randn(2048, generator=gen)
        xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
        g, u = (xn @ q.dequantize().cpu().double().T).chunk(2, dim=-1)
        for layout, w in (("plain", q), ("blocked", BlockedInt4Weight.from_int4(q))):
            got = cuda_ops.fused_linear(x.cuda(), w, norm_weight=nw.cuda(), eps=1e-6, act=cuda_ops.ACT_SWIGLU)
            kernels[f"rows={rows} g{group} {layout} f32 rel_frob"] = rel(got.cpu(), torch.nn.functional.silu(g) * u)
    # bf16 through the blocked tensor-core kernel (the CPU interpreter cannot check bf16 tl.dot)
    for rows, group in ((5, 64), (16, 32), (9, 128)):
        raw = torch.randn(2048, 2048, generator=gen) / 45
        q = quantize_int4(raw, group)
        x = torch.randn(rows, 2048, generator=gen).bfloat16()
        got = cuda_ops.fused_linear(x.cuda(), BlockedInt4Weight.from_int4(q).to("cuda"))
        ref = x.double() @ q.dequantize().double().T
        kernels[f"rows={rows} g{group} blocked bf16 rel_frob"] = rel(got.float().cpu(), ref)
    return {
        "int4_kernels_vs_float64": kernels,
        "tiny_default_dtype": compare_model("tiny", ids, 8, prompts),
        "seed407m_f32": compare_model(SEED_PATH, sid, 8, [sid[:16]], dtype=torch.float32) if FULL else None,
    }


def sweep_section() -> dict[str, Any]:
    """Blocked INT4 GEMV tiles per seed-407m shape (1 and 4 rows; the winners apply to later sections), the
    same weight reused from L2 (is the kernel bound by DRAM?), and optionally tensor-core tiles vs cuBLAS."""
    from tinyloop.kernels.cuda_backend import pdl_supported

    cuda_ops.USE_PDL = pdl_supported()  # as a CUDA engine runs them
    res: dict[str, Any] = {"matvec": {}, "matmul": {}, "pdl": cuda_ops.USE_PDL}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k, act) in SEED_SHAPES.items():
        ws = random_int4_copies(2 * n if act == 1 else n, k, gen)
        for rows in (1, 4):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            table = {}
            for cfg in GEMV_CANDIDATES:
                cuda_ops.BLOCKED_CONFIGS[(n, k, rows)] = cfg
                try:
                    table[str(cfg)] = time_cycling(x, ws, act)
                except Exception as exc:  # a tile the compiler refuses
                    table[str(cfg)] = {"error": str(exc)[:200]}
            ok = {c: v for c, v in table.items() if "us" in v}
            win = min(ok, key=lambda c: ok[c]["us"])
            cuda_ops.BLOCKED_CONFIGS[(n, k, rows)] = tuple(int(v) for v in win.strip("()").split(","))  # type: ignore[assignment]
            res["matvec"][f"{name} rows={rows}"] = {"best": win, **ok[win], "all": table}
            if rows == 1:  # the same weight every call: served from L2
                res["matvec"][f"{name} rows=1"]["l2_resident"] = time_cycling(x, ws[:1] * len(ws), act)
            print(name, rows, win, ok[win], flush=True)
        # Tensor-core tiles vs dequantize + cuBLAS for prefill-sized row counts.
        for rows in (16, 128, 1024) if name in ("qkv", "gate_up") and MATMUL_SWEEP else ():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            entry: dict[str, Any] = {}
            flops = 2 * rows * n * k * (2 if act else 1)
            for mcfg in [None, (64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (16, 64, 128, 4, 4)]:
                cuda_ops.MATMUL_CONFIG = mcfg
                old = cuda_ops.DOT_MAX_ROWS
                cuda_ops.DOT_MAX_ROWS = 10**9
                try:
                    t = graph_time(lambda x=x, w=ws[0], act=act: cuda_ops.fused_linear(x, w, act=act), 4, repeat=10)
                    entry[f"triton {mcfg}"] = {"us": t * 1e6, "TFLOPs": flops / t / 1e12}
                except Exception as exc:
                    entry[f"triton {mcfg}"] = {"error": str(exc)[:200]}
                finally:
                    cuda_ops.DOT_MAX_ROWS = old
                    cuda_ops.MATMUL_CONFIG = None
            cuda_ops.DOT_MAX_ROWS = 0
            try:
                t = graph_time(lambda x=x, w=ws[0], act=act: cuda_ops.fused_linear(x, w, act=act), 4, repeat=10)
                entry["dequant+cublas"] = {"us": t * 1e6, "TFLOPs": flops / t / 1e12}
            finally:
                cuda_ops.DOT_MAX_ROWS = old
            res["matmul"][f"{name} rows={rows}"] = entry
            print(name, rows, {k_: round(v.get("us", -1), 1) for k_, v in entry.items()}, flush=True)
        del ws
        torch.cuda.empty_cache()
    res["chosen_matvec"] = {str(k): v for k, v in cuda_ops.BLOCKED_CONFIGS.items()}
    # 32-column groups (32-column blocks), qkv shape, default tiles.
    n, k, _ = SEED_SHAPES["qkv"]
    ws = random_int4_copies(n, k, gen, group=32)
    res["matvec_group32"] = {
        f"qkv rows={rows}": time_cycling(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), ws, 0)
        for rows in (1, 4)
    }
    return res


RAW_DECODE_PROMPT = torch.as_tensor(np.random.default_rng(4).integers(0, 32000, (1, 128)), dtype=torch.long)


def _raw_decode(m: Any) -> Callable[[], float]:
    """A timer of 64 raw decode steps (engine.step, no sampling) at 8 loops after RAW_DECODE_PROMPT, in ms
    (median of 5 after a warm-up): positions 128-191, two blocks of 128 keys as in the benchmark's decode."""
    eng, loops, prompt_len = m._engine, 8, RAW_DECODE_PROMPT.shape[1]
    cache = eng.new_cache(1, 260, loops)
    eng.step(RAW_DECODE_PROMPT, cache, loops, last_only=True)
    tok = torch.tensor([[5]])

    def raw() -> None:
        cache.truncate(prompt_len)
        for _ in range(64):
            eng.step(tok, cache, loops, last_only=True)

    def ms() -> float:
        raw()
        return 1e3 * statistics.median(timed(raw, 5))

    return ms


def _recapturing_decode(m: Any) -> Callable[[], float]:
    """`_raw_decode` that re-captures the decode graphs first, so that tile settings changed since (read when
    a graph is captured) take effect."""
    from tinyloop.runtime.fused_decode import FusedDecoder

    decoder = m._engine.decoder
    assert isinstance(decoder, FusedDecoder)
    decode = _raw_decode(m)

    def ms() -> float:
        decoder._graphs.clear()
        decoder._seen.clear()
        return decode()

    return ms


def _fresh_seed_decode() -> tuple[float, list[int]]:
    """A fresh seed-407m model (graphs captured with the current settings): `_raw_decode`'s ms and 32 greedy
    tokens after RAW_DECODE_PROMPT at 8 loops."""
    m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
    ms = _raw_decode(m)()
    tokens = [int(t) for t in m.generate(RAW_DECODE_PROMPT[0].numpy(), 32, loops=8, temperature=0.0)]
    m.close()
    return ms, tokens


def _fresh_chain_ab(switch: str, off_name: str, on_name: str) -> dict[str, Any]:
    """`_fresh_seed_decode` with the environment switch `switch` set ("1": `off_name`) and cleared (`on_name`),
    alternated twice: ms per setting and whether the greedy tokens agree (else the first difference)."""
    chain: dict[str, list[float]] = {off_name: [], on_name: []}
    tokens = {}
    for _ in range(2):
        for setting in chain:
            t, tokens[setting] = with_env({switch: "1" if setting == off_name else "0"}, _fresh_seed_decode)
            chain[setting].append(t)
    pairs = zip(tokens[off_name], tokens[on_name], strict=True)
    return {
        "chain_ms": chain,
        "greedy_tokens_identical": tokens[off_name] == tokens[on_name],
        "greedy_first_difference": next((i for i, (a, b) in enumerate(pairs) if a != b), None),
    }


# The session-6 and session-7 winners and their neighbours (more or fewer rows, blocks, warps).
CHAIN_CANDIDATES = [(8, 8, 4), (4, 32, 8), (2, 32, 4), (4, 8, 2), (4, 16, 4), (2, 8, 1), (4, 8, 4), (8, 32, 8),
                    (2, 16, 2)]  # fmt: skip


def chain_tiles_section() -> dict[str, Any]:
    """One-row GEMV tiles chosen in the model's own kernel chain: seed-407m decode (loops 8, 64 raw steps
    after a 128-token prompt) per tile of each matrix, coordinate descent from the built-in tiles. Tiles
    that tie in isolation (the sweep: one shape back to back) can differ by whole microseconds here, where
    each GEMV follows a different kernel. Then the one-token attention's (keys per block, warps). The
    winners apply to later sections."""
    wait_for_models(SEED_PATH)
    m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
    decode_ms = _recapturing_decode(m)

    cuda_ops.BLOCKED_CONFIGS.clear()
    res: dict[str, Any] = {"built_in_ms": decode_ms(), "by_matrix": {}}
    for name in ("gate_up", "down", "qkv", "out", "head"):
        n, k, _ = SEED_SHAPES[name]
        key = (n, k, 1)
        table = {}
        for cand in CHAIN_CANDIDATES:
            cuda_ops.BLOCKED_CONFIGS[key] = cand
            table[str(cand)] = decode_ms()
        win = min(table, key=lambda c: table[c])
        cuda_ops.BLOCKED_CONFIGS[key] = tuple(int(v) for v in win.strip("()").split(","))  # type: ignore[assignment]
        res["by_matrix"][name] = {"best": win, "ms": table}
        print("chain", name, win, {c: round(v, 2) for c, v in table.items()}, flush=True)
    table = {}
    for block, warps in ((256, 8), (256, 16), (128, 8), (128, 4), (64, 4)):  # one-token attention, 128-191 keys
        cuda_ops.ATTENTION_BLOCK, cuda_ops.ATTENTION_WARPS = block, warps
        table[f"({block}, {warps})"] = decode_ms()
    win = min(table, key=lambda c: table[c])
    cuda_ops.ATTENTION_BLOCK, cuda_ops.ATTENTION_WARPS = (int(v) for v in win.strip("()").split(","))
    res["attention"] = {"best": win, "ms": table}
    print("chain attention", win, {c: round(v, 2) for c, v in table.items()}, flush=True)
    res["chosen_ms"] = decode_ms()
    res["chosen"] = {str(k): v for k, v in cuda_ops.BLOCKED_CONFIGS.items()}
    m.close()
    torch.cuda.empty_cache()
    return res


def maxnreg_section() -> dict[str, Any]:
    """The decode GEMV under register caps (cuda_ops.GEMV_MAX_REGISTERS): seed-407m, 64 raw decode steps at 8
    loops after a 128-token prompt, a fresh model per setting (graphs captured with it), settings alternated
    twice, and greedy tokens. The fastest applies to later sections."""
    wait_for_models(SEED_PATH)

    settings = [None, 128, 96, 80]
    ms: dict[str, list[float]] = {str(c): [] for c in settings}
    tokens = {}
    for _ in range(2):
        for cap in settings:
            cuda_ops.GEMV_MAX_REGISTERS = cap
            t, tokens[str(cap)] = _fresh_seed_decode()
            ms[str(cap)].append(t)
    best = min(ms, key=lambda c: statistics.median(ms[c]))
    cuda_ops.GEMV_MAX_REGISTERS = None if best == "None" else int(best)
    res = {"ms": ms, "best": best, "identical_tokens": len({tuple(t) for t in tokens.values()}) == 1}
    print("maxnreg", res, flush=True)
    torch.cuda.empty_cache()
    return res


# (rows per thread, lanes along rows, blocks per thread, warps along rows, warps along blocks) per activation
GLUON_CANDIDATES = {
    0: [(4, 1, 1, 2, 1), (4, 1, 1, 1, 1), (4, 1, 1, 4, 1), (2, 1, 1, 2, 1), (2, 1, 1, 1, 1), (4, 1, 1, 2, 2),
        (8, 1, 1, 1, 1), (2, 2, 1, 2, 1), (2, 1, 1, 4, 1)],
    1: [(2, 1, 1, 2, 1), (2, 1, 1, 1, 1), (2, 1, 1, 4, 1), (4, 1, 1, 1, 1), (2, 2, 1, 2, 1), (1, 1, 1, 2, 1),
        (1, 1, 1, 4, 1)],
}  # fmt: skip


def _gemv_reference(x: torch.Tensor, q: Int4Weight, nw: Any, bias: Any, act: int, residual: Any) -> torch.Tensor:
    """Float64 on the CPU, no rounding on the way: norm, matmul, bias, activation, residual."""
    h = x.double().cpu()
    if nw is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double().cpu()
    y = h @ q.dequantize().cpu().double().T
    if bias is not None:
        y = y + bias.double().cpu()
    if act == cuda_ops.ACT_SWIGLU:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    elif act == cuda_ops.ACT_GELU:
        y = torch.nn.functional.gelu(y)
    return y if residual is None else y + residual.double().cpu()


ONE_ROW_CASES = [  # (N, K, act, norm, residual, bias, dtype)
    (6144, 2048, 0, True, False, False, torch.bfloat16), (2048, 2048, 0, False, True, False, torch.bfloat16),
    (5632, 2048, 1, True, False, False, torch.bfloat16), (2048, 5632, 0, False, True, False, torch.bfloat16),
    (32000, 2048, 0, True, False, False, torch.bfloat16), (1000, 5632, 2, True, True, True, torch.float32),
    (1152, 384, 1, True, False, False, torch.float32), (384, 1024, 0, False, True, True, torch.float32),
    (6144, 2048, 0, True, True, False, torch.float32), (5632, 2048, 1, True, False, False, torch.float32),
    (77, 1536, 1, True, True, False, torch.float16), (1000, 2048, 2, True, True, True, torch.bfloat16),
]  # fmt: skip


def _apply(switches: dict[str, Any]) -> None:
    """Set cuda_ops module switches by name."""
    for attr, value in switches.items():
        setattr(cuda_ops, attr, value)


def _one_row_checks(settings: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """One-row fused_linear on ONE_ROW_CASES under each setting of cuda_ops switches: relative error against
    float64 and against the first setting."""
    gen = torch.Generator().manual_seed(1)
    checks = {}
    for n, k, act, norm, resid, bias, dt in ONE_ROW_CASES:
        rows = 2 * n if act == cuda_ops.ACT_SWIGLU else n
        q = quantize_int4(torch.randn(rows, k, generator=gen) / 45, 64)
        w = BlockedInt4Weight.from_int4(q).to("cuda")
        x = torch.randn(1, k, generator=gen).to(dt)
        nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dt) if norm else None
        b = (0.1 * torch.randn(n, generator=gen)).to(dt) if bias else None
        r = torch.randn(1, n, generator=gen).to(dt) if resid else None
        got = {}
        for name, switches in settings.items():
            _apply(switches)
            got[name] = cuda_ops.fused_linear(x.cuda(), w, norm_weight=None if nw is None else nw.cuda(), eps=1e-6,
                                              bias=None if b is None else b.cuda(), act=act,
                                              residual=None if r is None else r.cuda()).float().cpu()  # fmt: skip
        ref = _gemv_reference(x, q, nw, b, act, r)
        first = next(iter(got))
        key = f"{n}x{k} act{act} norm{int(norm)} res{int(resid)} bias{int(bias)} {str(dt)[6:]}"
        checks[key] = {f"{name}_vs_f64": rel(g, ref) for name, g in got.items()}
        checks[key].update({f"{name}_vs_{first}": rel(g, got[first]) for name, g in got.items() if name != first})
        print("one-row check", key, {c: f"{v:.2e}" for c, v in checks[key].items()}, flush=True)
    return checks


# cuda_ops.STAGED_LAYOUT candidates (rows per thread, warps, register cap), the default first
STAGED_LAYOUTS = [(2, 8, 0), (1, 16, 0), (1, 16, 64)]
# One staged-GEMV call (every shape staged, on tensor cores if argv[1] is "1") and its error against float64.
STAGED_SMOKE = """
import sys, torch
from tinyloop.kernels import cuda_ops
from tinyloop.kernels.cuda_backend import pdl_supported, staged_supported
from tinyloop.quant import BlockedInt4Weight, quantize_int4
cuda_ops.USE_PDL, cuda_ops.USE_STAGED_GEMV = pdl_supported(), staged_supported()
cuda_ops.STAGED_MMA_SHAPES = None if sys.argv[1] == "1" else frozenset()
cuda_ops.STAGED_SHAPES = None
q = quantize_int4(torch.randn(2048, 2048) / 45, 64)
x = torch.randn(1, 2048).bfloat16()
y = cuda_ops.fused_linear(x.cuda(), BlockedInt4Weight.from_int4(q).to("cuda"))
torch.cuda.synchronize()
ref = x.double() @ q.dequantize().double().T
print("staged smoke ok", cuda_ops.USE_STAGED_GEMV, float((y.double().cpu() - ref).norm() / ref.norm()))
"""


def _one_row_alone(settings: dict[str, dict[str, Any]], shapes: tuple[str, ...], label: str) -> dict[str, Any]:
    """One bf16 row times each named seed-407m shape under each setting of cuda_ops switches, alone: copies
    streamed from DRAM, back to back in a graph (`time_cycling`). {shape: {setting: timing}}."""
    alone: dict[str, Any] = {}
    gen_cuda = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        n, k, act = SEED_SHAPES[name]
        ws = random_int4_copies(2 * n if act == 1 else n, k, gen_cuda)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        alone[name] = {}
        for setting, switches in settings.items():
            _apply(switches)
            alone[name][setting] = time_cycling(x, ws, act)
        print(label, name, {c: round(v["us"], 2) for c, v in alone[name].items()}, flush=True)
        del ws
        torch.cuda.empty_cache()
    return alone


def _staged_smoke(mma: bool) -> dict[str, Any]:
    """STAGED_SMOKE in a child process (a wrong barrier count would hang, not fail): its exit status and output."""
    try:
        run = subprocess.run([sys.executable, "-c", STAGED_SMOKE, "1" if mma else "0"], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        out = {"rc": run.returncode, "out": run.stdout[-500:], "err": run.stderr[-3000:]}
    except subprocess.TimeoutExpired:
        out = {"rc": "timeout"}
    print("staged smoke", "mma" if mma else "cuda cores", out, flush=True)
    return out


def staged_section() -> dict[str, Any]:
    """The staged GEMV (kernels/gluon_gemv_staged.py): one call in a child process first (a wrong barrier
    count would hang, not fail), then against float64, the plain Gluon GEMV and the Triton one; alone per
    seed-407m shape (copies streamed from DRAM, back to back in a graph); in the chain (fresh seed-407m models
    with it on and off, alternated twice, greedy tokens); early launch of the next kernel on and off."""
    from tinyloop.kernels.cuda_backend import pdl_supported, staged_supported

    cuda_ops.USE_PDL = pdl_supported()
    res: dict[str, Any] = {"supported": staged_supported()}
    if not res["supported"]:
        return res
    res["smoke"] = _staged_smoke(mma=False)
    if res["smoke"]["rc"] != 0:
        return res
    on: dict[str, Any] = {"USE_STAGED_GEMV": True, "USE_GLUON_GEMV": True}
    settings = {f"staged{layout}": {**on, "STAGED_LAYOUT": layout} for layout in STAGED_LAYOUTS}
    settings["gluon"] = {**on, "USE_STAGED_GEMV": False}
    settings["triton"] = {"USE_STAGED_GEMV": False, "USE_GLUON_GEMV": False}
    res["checks"] = _one_row_checks(settings)
    res["alone"] = _one_row_alone(settings, tuple(SEED_SHAPES), "staged alone")
    cuda_ops.STAGED_LAYOUT = STAGED_LAYOUTS[0]
    wait_for_models(SEED_PATH)
    res.update(_fresh_chain_ab("TINYLOOP_DISABLE_STAGED_GEMV", "gluon", "staged"))
    print("staged chain", res["chain_ms"], res["greedy_tokens_identical"], flush=True)
    m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
    decode_ms = _recapturing_decode(m)
    variants: dict[str, list[float]] = {}
    for _ in range(2):
        for layout in STAGED_LAYOUTS:
            for launch in ("after_wait", "before_wait"):
                cuda_ops.STAGED_LAYOUT, cuda_ops.STAGED_LAUNCH_DEPENDENTS = layout, launch
                variants.setdefault(f"{layout} launch={launch}", []).append(decode_ms())
    res["variants_ms"] = variants
    best = min(variants, key=lambda v: min(variants[v]))
    cuda_ops.STAGED_LAYOUT = next(la for la in STAGED_LAYOUTS if best.startswith(str(la)))
    cuda_ops.STAGED_LAUNCH_DEPENDENTS = best.rsplit("=", 1)[1]
    print("staged variants", variants, flush=True)
    m.close()
    torch.cuda.empty_cache()
    return res


QKV_SHAPE, GATE_UP_SHAPE = (6144, 2048, 0), (5632, 2048, 1)


def _timeline_by_kernel(timeline: dict[str, Any]) -> dict[str, list[float]]:
    """A step timeline's kernels grouped by name: [launches, mean µs from launch to end, mean µs the kernel adds
    to the step (its end minus the previous kernel's end: under PDL a kernel starts early and waits, so its
    duration overlaps its predecessor's)]."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for name, us, gap in timeline["step"][1:]:
        groups.setdefault(name, []).append((us, us + gap))
    return {name: [len(v), round(statistics.mean(d for d, _ in v), 2), round(statistics.mean(a for _, a in v), 2)]
            for name, v in groups.items()}  # fmt: skip


def staged_mma_timeline_section() -> dict[str, Any]:
    """Why the tensor-core staged GEMV loses in the chain: one seed-407m decode step's kernels (grouped by name,
    with the time each adds to the step, and one body layer in order) with QKV + gate / up on the CUDA-core and
    on the tensor-core staged kernel, with and without PDL; and 64 raw decode steps of fresh models under each."""
    wait_for_models(SEED_PATH)
    base = {"USE_STAGED_GEMV": True, "USE_GLUON_GEMV": True, "STAGED_SHAPES": frozenset({QKV_SHAPE, GATE_UP_SHAPE}),
            "STAGED_MMA_PROGRAMS_PER_SM": 1}  # fmt: skip
    policies = {"cuda cores": {**base, "STAGED_MMA_SHAPES": frozenset()}, "mma": {**base, "STAGED_MMA_SHAPES": None}}
    res: dict[str, Any] = {}
    for pdl in (True, False):
        for name, switches in policies.items():
            _apply(switches)
            key = f"{name}, {'pdl' if pdl else 'no pdl'}"
            tl = _step_timeline(pdl)
            ms = _fresh_seed_decode()[0] if pdl else with_env({"TINYLOOP_DISABLE_PDL": "1"}, _fresh_seed_decode)[0]
            names = [row[0] for row in tl["step"]]
            qkv = [i for i, n in enumerate(names) if n.startswith("_gemv_int4_staged")]
            layer = tl["step"][qkv[8] - 1 : qkv[8] + 6] if len(qkv) > 8 else []
            res[key] = {"chain_ms": ms, "span_us": tl["step_span_us"], "by_kernel": _timeline_by_kernel(tl),
                        "body_layer": layer}  # fmt: skip
            print("mma timeline", key, round(ms, 2), round(tl["step_span_us"], 1), res[key]["by_kernel"], flush=True)
            for row in layer:
                print("   ", row, flush=True)
    _apply(policies["cuda cores"])
    return res


def staged_mma_section() -> dict[str, Any]:
    """The staged GEMV on tensor cores (cuda_ops.STAGED_MMA_SHAPES, kernels/gluon_gemv_staged_mma.py): one call
    in a child process first (a wrong barrier count would hang), then against float64 and the CUDA-core staged
    and Gluon GEMVs; alone per seed-407m shape; in the chain: 64 raw decode steps of one seed-407m model (graphs
    re-captured) per policy, alternated twice; one step's kernels (PDL on) per policy, grouped by kernel; and the
    fastest policy's greedy tokens against the committed setting's on fresh models. The fastest applies to later
    sections where its tokens agree."""
    from tinyloop.kernels.cuda_backend import pdl_supported, staged_supported

    cuda_ops.USE_PDL = pdl_supported()
    res: dict[str, Any] = {"supported": staged_supported()}
    if not res["supported"]:
        return res
    res["smoke"] = _staged_smoke(mma=True)
    if res["smoke"]["rc"] != 0:
        return res
    committed: dict[str, Any] = {"USE_STAGED_GEMV": True, "USE_GLUON_GEMV": True,
                                 "STAGED_MMA_SHAPES": cuda_ops.STAGED_MMA_SHAPES,
                                 "STAGED_SHAPES": cuda_ops.STAGED_SHAPES, "STAGED_MMA_PROGRAMS_PER_SM": 1}  # fmt: skip
    mma_all = {**committed, "STAGED_MMA_SHAPES": None, "STAGED_SHAPES": None}
    settings = {"mma": mma_all, "mma 3 per SM": {**mma_all, "STAGED_MMA_PROGRAMS_PER_SM": 3},
                "staged": {**committed, "STAGED_MMA_SHAPES": frozenset(), "STAGED_SHAPES": None},
                "gluon": {**committed, "USE_STAGED_GEMV": False}}  # fmt: skip
    res["checks"] = _one_row_checks(settings)
    res["alone"] = _one_row_alone(settings, ("qkv", "out", "gate_up", "down"), "staged mma alone")
    staged = {**committed, "STAGED_SHAPES": frozenset({QKV_SHAPE, GATE_UP_SHAPE})}
    policies = {"committed": committed, "cuda cores": {**staged, "STAGED_MMA_SHAPES": frozenset()},
                "mma gate_up": {**staged, "STAGED_MMA_SHAPES": frozenset({GATE_UP_SHAPE})},
                "mma qkv": {**staged, "STAGED_MMA_SHAPES": frozenset({QKV_SHAPE})},
                "mma qkv+gate_up": {**staged, "STAGED_MMA_SHAPES": None}}  # fmt: skip
    res["chain_ms"] = chain = _chain_policies(policies)
    print("staged mma chain", chain, flush=True)
    res["timeline"] = {}
    for name in ("cuda cores", "mma qkv+gate_up"):
        _apply(policies[name])
        res["timeline"][name] = _timeline_by_kernel(_step_timeline(True))
        print("staged mma timeline", name, res["timeline"][name], flush=True)
    res["best"], res["greedy_tokens_identical"] = _adopt_fastest(policies, chain)
    print("staged mma best", res["best"], res["greedy_tokens_identical"], flush=True)
    torch.cuda.empty_cache()
    return res


def _chain_policies(policies: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """64 raw decode steps of one seed-407m model (graphs re-captured) under each policy (cuda_ops switches),
    the policies alternated twice: ms per policy."""
    wait_for_models(SEED_PATH)
    m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
    decode_ms = _recapturing_decode(m)
    chain: dict[str, list[float]] = {}
    for _ in range(2):
        for name, switches in policies.items():
            _apply(switches)
            chain.setdefault(name, []).append(decode_ms())
    m.close()
    return chain


def _adopt_fastest(policies: dict[str, dict[str, Any]], chain: dict[str, list[float]]) -> tuple[str, bool]:
    """The fastest policy of `chain` and whether its greedy tokens (fresh models) equal the "committed" policy's;
    it is applied where they do, else "committed" is."""
    best = min(chain, key=lambda c: min(chain[c]))
    tokens = {}
    for name in dict.fromkeys(("committed", best)):
        _apply(policies[name])
        tokens[name] = _fresh_seed_decode()[1]
    identical = tokens[best] == tokens["committed"]
    _apply(policies[best] if identical else policies["committed"])
    return best, identical


def launch_placement_section() -> dict[str, Any]:
    """Where the decode GEMVs let the next kernel launch under PDL (cuda_ops.STAGED_LAUNCH_DEPENDENTS,
    GLUON_LAUNCH_DEPENDENTS: right after their own wait, or at their end so that the next kernel's programs never
    share an SM with their arithmetic), with QKV + gate / up on the CUDA-core or the tensor-core staged kernel:
    64 raw decode steps of one seed-407m model (graphs re-captured) per policy, alternated twice; the fastest
    policy's greedy tokens against the committed setting's on fresh models. The fastest applies to later sections
    where its tokens agree."""
    wait_for_models(SEED_PATH)
    committed = {"USE_STAGED_GEMV": True, "USE_GLUON_GEMV": True, "STAGED_SHAPES": cuda_ops.STAGED_SHAPES,
                 "STAGED_MMA_SHAPES": cuda_ops.STAGED_MMA_SHAPES, "STAGED_MMA_PROGRAMS_PER_SM": 1,
                 "STAGED_LAUNCH_DEPENDENTS": cuda_ops.STAGED_LAUNCH_DEPENDENTS,
                 "GLUON_LAUNCH_DEPENDENTS": cuda_ops.GLUON_LAUNCH_DEPENDENTS}  # fmt: skip
    staged_end = {**committed, "STAGED_LAUNCH_DEPENDENTS": "at_end"}
    gate_up = frozenset({GATE_UP_SHAPE})
    policies = {"committed": committed, "staged at end": staged_end,
                "gluon at end": {**committed, "GLUON_LAUNCH_DEPENDENTS": "at_end"},
                "both at end": {**staged_end, "GLUON_LAUNCH_DEPENDENTS": "at_end"},
                "mma gate_up": {**committed, "STAGED_MMA_SHAPES": gate_up},
                "mma gate_up, staged at end": {**staged_end, "STAGED_MMA_SHAPES": gate_up},
                "mma gate_up, gluon at end": {**committed, "STAGED_MMA_SHAPES": gate_up,
                                              "GLUON_LAUNCH_DEPENDENTS": "at_end"},
                "mma qkv+gate_up, staged at end": {**staged_end, "STAGED_MMA_SHAPES": None}}  # fmt: skip
    chain = _chain_policies(policies)
    print("launch placement chain", chain, flush=True)
    best, identical = _adopt_fastest(policies, chain)
    print("launch placement best", best, identical, flush=True)
    torch.cuda.empty_cache()
    return {"chain_ms": chain, "best": best, "greedy_tokens_identical": identical}


# cuda_ops.SPLIT_ATTENTION candidates: (splits, keys per block, warps); None: one program per head.
SPLIT_CANDIDATES: list[tuple[int, int, int] | None] = [None, (2, 128, 4), (4, 64, 4), (8, 32, 4), (4, 64, 8)]


def attention_split_section() -> dict[str, Any]:
    """One-token attention split along the keys (cuda_ops.SPLIT_ATTENTION) in the chain: seed-407m, 64 raw
    decode steps at 8 loops after a 128-token prompt (129-192 keys), each candidate twice on one model; then
    32 greedy tokens with the winner and without splits on fresh models. The winner applies to later
    sections where its tokens agree."""
    wait_for_models(SEED_PATH)
    m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
    decode_ms = _recapturing_decode(m)
    table: dict[str, list[float]] = {}
    for _ in range(2):
        for cand in SPLIT_CANDIDATES:
            cuda_ops.SPLIT_ATTENTION = cand
            table.setdefault(str(cand), []).append(decode_ms())
    m.close()
    best = min(SPLIT_CANDIDATES, key=lambda c: min(table[str(c)]))
    tokens = {}
    for cand in (None, best):
        cuda_ops.SPLIT_ATTENTION = cand
        tokens[str(cand)] = _fresh_seed_decode()[1]
    identical = tokens["None"] == tokens[str(best)]
    cuda_ops.SPLIT_ATTENTION = best if identical else None
    print("attention split", {c: [round(v, 2) for v in t] for c, t in table.items()}, best, identical, flush=True)
    torch.cuda.empty_cache()
    return {"ms": table, "best": str(best), "greedy_tokens_identical": identical}


def tiny_split_section() -> dict[str, Any]:
    """Key-split one-token attention on the built-in model (6 heads of 64, below
    cuda_ops.SPLIT_ATTENTION_MIN_HEAD_DIM): decode tokens/s at 8 loops split as cuda_ops.SPLIT_ATTENTION and
    whole (as committed), fresh models alternated twice."""
    committed = cuda_ops.SPLIT_ATTENTION_MIN_HEAD_DIM
    rates: dict[str, list[float]] = {}
    for _ in range(2):
        for name, min_dim in (("split", 0), ("whole", 10**9)):
            cuda_ops.SPLIT_ATTENTION_MIN_HEAD_DIM = min_dim
            rates.setdefault(name, []).append(loops_curve("tiny", (8,))["8"])
    cuda_ops.SPLIT_ATTENTION_MIN_HEAD_DIM = committed
    print("tiny split attention", rates, flush=True)
    return {"split": str(cuda_ops.SPLIT_ATTENTION), "tokens_per_s": rates}


STAGED_POLICIES: dict[str, frozenset[tuple[int, int, int]] | None] = {
    "all": None, "qkv": frozenset({(6144, 2048, 0)}), "qkv+gate_up": frozenset({(6144, 2048, 0), (5632, 2048, 1)}),
}  # fmt: skip


def staged_policy_section() -> dict[str, Any]:
    """Which seed-407m matrices take the staged GEMV (cuda_ops.STAGED_SHAPES), off included, in the chain: 64
    raw decode steps at 8 loops after a 128-token prompt, each policy twice on one model. The winner applies
    to later sections (off: through TINYLOOP_DISABLE_STAGED_GEMV, which later models read)."""
    from tinyloop.kernels.cuda_backend import staged_supported

    wait_for_models(SEED_PATH)
    m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
    decode_ms = _recapturing_decode(m)
    table: dict[str, list[float]] = {}
    for _ in range(2):
        cuda_ops.USE_STAGED_GEMV = False
        table.setdefault("off", []).append(decode_ms())
        cuda_ops.USE_STAGED_GEMV = staged_supported()
        for name, shapes in STAGED_POLICIES.items():
            cuda_ops.STAGED_SHAPES = shapes
            table.setdefault(name, []).append(decode_ms())
    m.close()
    best = min(table, key=lambda c: min(table[c]))
    if best == "off":
        os.environ["TINYLOOP_DISABLE_STAGED_GEMV"] = "1"
    else:
        cuda_ops.STAGED_SHAPES = STAGED_POLICIES[best]
    print("staged policy", table, best, flush=True)
    torch.cuda.empty_cache()
    return {"ms": table, "best": best}


def gluon_section() -> dict[str, Any]:
    """The Gluon decode GEMV (kernels/gluon_gemv.py) against float64 and the Triton GEMV, then alone per
    seed-407m shape (tiles, weights streamed from DRAM) and in the model's chain: seed-407m, 64 raw decode
    steps at 8 loops after a 128-token prompt, a fresh model per setting, alternated twice, greedy tokens.
    The best tiles apply to later sections."""
    from tinyloop.kernels.cuda_backend import gluon_supported, pdl_supported

    cuda_ops.USE_PDL = pdl_supported()
    res: dict[str, Any] = {"supported": gluon_supported(), "checks": {}, "alone": {}}
    if not res["supported"]:
        return res
    res["checks"] = _one_row_checks({"gluon": {"USE_STAGED_GEMV": False, "USE_GLUON_GEMV": True},
                                     "triton": {"USE_STAGED_GEMV": False, "USE_GLUON_GEMV": False}})  # fmt: skip
    cuda_ops.USE_STAGED_GEMV = False
    gen_cuda = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k, act) in SEED_SHAPES.items():
        ws = random_int4_copies(2 * n if act == 1 else n, k, gen_cuda)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cuda_ops.USE_GLUON_GEMV = False
        table: dict[str, Any] = {"triton": time_cycling(x, ws, act)}
        cuda_ops.USE_GLUON_GEMV = True
        for cand in GLUON_CANDIDATES[act]:
            cuda_ops.GLUON_TILES[(n, k, act)] = cand
            try:
                table[str(cand)] = time_cycling(x, ws, act)
            except Exception as exc:
                table[str(cand)] = {"error": str(exc)[:300]}
        ok = {c: v for c, v in table.items() if "us" in v and c != "triton"}
        win = min(ok, key=lambda c: ok[c]["us"])
        cuda_ops.GLUON_TILES[(n, k, act)] = tuple(int(v) for v in win.strip("()").split(","))  # type: ignore[assignment]
        res["alone"][name] = {"best": win, "all": table}
        print("gluon alone", name, {c: round(v.get("us", -1), 2) for c, v in table.items()}, flush=True)
        del ws
        torch.cuda.empty_cache()
    res["tiles"] = {str(k): v for k, v in cuda_ops.GLUON_TILES.items()}
    wait_for_models(SEED_PATH)

    res.update(_fresh_chain_ab("TINYLOOP_DISABLE_GLUON_GEMV", "triton", "gluon"))
    print("gluon chain", res["chain_ms"], res["greedy_tokens_identical"], flush=True)
    torch.cuda.empty_cache()
    return res


def _step_timeline(pdl: bool) -> dict[str, Any]:
    """Kernels of one raw decode step of seed-407m (loops 8, position 160 of 64 profiled steps after a
    128-token prompt) in launch order: name, duration and the gap since the previous kernel ended (negative:
    overlap under PDL)."""
    from torch.profiler import ProfilerActivity, profile

    def run() -> dict[str, Any]:
        m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
        eng, loops, steps = m._engine, 8, 64
        cache = eng.new_cache(1, 260, loops)
        eng.step(RAW_DECODE_PROMPT, cache, loops, last_only=True)
        tok = torch.tensor([[5]])
        for _ in range(2):  # graphs captured, then warm
            cache.truncate(RAW_DECODE_PROMPT.shape[1])
            for _ in range(steps):
                eng.step(tok, cache, loops, last_only=True)
        cache.truncate(RAW_DECODE_PROMPT.shape[1])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step(tok, cache, loops, last_only=True)
            torch.cuda.synchronize()
        m.close()
        evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda ev: ev.time_range.start)  # fmt: skip
        per_step = len(evs) // steps
        first = per_step * (steps // 2)
        seq = []
        for i in range(first, first + per_step):
            ev = evs[i]
            gap = ev.time_range.start - evs[i - 1].time_range.end
            seq.append([ev.name[:40], round(ev.time_range.end - ev.time_range.start, 2), round(gap, 2)])
        span = evs[first + per_step - 1].time_range.end - evs[first].time_range.start
        return {"kernels_per_step": per_step, "step_span_us": span, "step": seq,
                "step_busy_us": sum(r[1] for r in seq), "step_gaps_us": sum(r[2] for r in seq[1:])}  # fmt: skip

    return run() if pdl else with_env({"TINYLOOP_DISABLE_PDL": "1"}, run)


def timeline_section() -> dict[str, Any]:
    """One decode step's kernels in order, with and without PDL (see _step_timeline)."""
    wait_for_models(SEED_PATH)
    res = {"pdl": _step_timeline(True), "no_pdl": _step_timeline(False)}
    for k, v in res.items():
        print("timeline", k, v["kernels_per_step"], round(v["step_span_us"], 1), round(v["step_busy_us"], 1),
              round(v["step_gaps_us"], 1))  # fmt: skip
        for row in v["step"][:24]:
            print("   ", row, flush=True)
    return res


def gluon_chain_section() -> dict[str, Any]:
    """Gluon GEMV tiles chosen in the model's chain (as chain_tiles does for the Triton GEMV): seed-407m, 64
    raw decode steps at 8 loops after a 128-token prompt, coordinate descent from the built-in tiles; then
    PDL early launch on and off with the chosen tiles. The winners apply to later sections."""
    wait_for_models(SEED_PATH)
    m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
    decode_ms = _recapturing_decode(m)

    res: dict[str, Any] = {"built_in_ms": decode_ms(), "by_matrix": {}}
    for name in ("gate_up", "qkv", "down", "out", "head"):
        n, k, act = SEED_SHAPES[name]
        key = (n, k, act)
        table = {"built_in": res["built_in_ms"]} if not res["by_matrix"] else {}
        start = cuda_ops._gluon_tile(n, k, act)
        for cand in [start] + [c for c in GLUON_CANDIDATES[act] if c != start]:
            cuda_ops.GLUON_TILES[key] = cand
            try:
                table[str(cand)] = decode_ms()
            except Exception as exc:
                table[str(cand)] = float("inf")
                print("gluon chain", name, cand, "failed", str(exc)[:200], flush=True)
        best = min((c for c in table if c != "built_in"), key=lambda c: table[c])
        cuda_ops.GLUON_TILES[key] = tuple(int(v) for v in best.strip("()").split(","))  # type: ignore[assignment]
        res["by_matrix"][name] = {"best": best, "ms": table}
        print("gluon chain", name, best, {c: round(v, 2) for c, v in table.items()}, flush=True)
    res["chosen"] = {str(k): v for k, v in cuda_ops.GLUON_TILES.items()}
    res["chosen_ms"] = decode_ms()
    early = {}
    for flag in (True, False, True, False):
        cuda_ops.PDL_EARLY_LAUNCH = flag
        early.setdefault(str(flag), []).append(decode_ms())
    cuda_ops.PDL_EARLY_LAUNCH = False
    res["pdl_early_ms"] = early
    print("gluon chain pdl early", early, flush=True)
    m.close()
    torch.cuda.empty_cache()
    return res


def tiny_gemv_section() -> dict[str, Any]:
    """The built-in model's decode tokens/s at 8 loops with the Gluon GEMV and with the Triton one (a fresh
    model per setting, alternated twice): its matrices (d_model 384, 6 blocks of 64 columns) are far smaller
    than the ones the Gluon tiles were chosen for."""
    res: dict[str, list[float]] = {"triton": [], "gluon": []}
    for _ in range(2):
        for setting in res:
            off = {"TINYLOOP_DISABLE_GLUON_GEMV": "1" if setting == "triton" else "0"}
            res[setting].append(with_env(off, lambda: loops_curve("tiny", (8,)))["8"])
    print("tiny gemv", res, flush=True)
    return res


def pdl_early_section() -> dict[str, Any]:
    """Each kernel letting the next one launch before its own PDL wait (cuda_ops.PDL_EARLY_LAUNCH) against
    launching it after: seed-407m greedy tokens and decode time, then the seed407m numbers with it where it
    wins. Last in a run: a hang here would lose nothing already saved."""
    wait_for_models(SEED_PATH)
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, 32000, 64).astype(np.int32)
    res: dict[str, Any] = {}
    for early in (False, True):
        cuda_ops.PDL_EARLY_LAUNCH = early
        m = tinyloop.Model(SEED_PATH, max_seq_len=512, device="cuda")
        tokens = m.generate(prompt, 64, loops=8, temperature=0.0)
        ms = statistics.median(timed(lambda m=m: m.generate(prompt, 128, loops=8, temperature=0.0), 5))
        res[f"early={early}"] = {"generate_128_ms": 1e3 * ms, "tokens": [int(t) for t in tokens]}
        m.close()
        print("pdl early", early, round(1e3 * ms, 2), flush=True)
    res["identical_tokens"] = res["early=False"]["tokens"] == res["early=True"]["tokens"]
    keep = res["identical_tokens"] and res["early=True"]["generate_128_ms"] < res["early=False"]["generate_128_ms"]
    cuda_ops.PDL_EARLY_LAUNCH = keep
    if keep:
        res["seed407m_int4"] = generation_numbers(SEED_PATH, 8)
        print("int4 with early launch", res["seed407m_int4"], flush=True)
    torch.cuda.empty_cache()
    return res


def _tile_sweep(
    label: str,
    x: torch.Tensor,
    ws: list[BlockedInt4Weight],
    act: int,
    candidates: list[tuple],
    configs: dict,
    key: tuple[int, int, int],
    baseline: tuple[str, Callable[[], dict[str, float]]],
) -> dict[str, Any]:
    """Each candidate tile (set as configs[key]) timed over the weight copies, then the baseline (its name and
    a timer that switches the kernel off itself); the fastest tile stays in configs. Returns the best tile,
    its µs, the baseline's µs and every timing (with TFLOP/s)."""
    table: dict[str, Any] = {}
    for cfg in candidates:
        configs[key] = cfg
        try:
            table[str(cfg)] = time_cycling(x, ws, act)
        except Exception as exc:
            table[str(cfg)] = {"error": str(exc)[:200]}
    base_name, base_timer = baseline
    table[base_name] = base_timer()
    flops = 2 * x.shape[0] * x.shape[1] * ws[0].shape[0]
    for v in table.values():
        if "us" in v:
            v["TFLOPs"] = flops / v["us"] / 1e6
    ok = {c: v for c, v in table.items() if "us" in v and c.startswith("(")}
    win = min(ok, key=lambda c: ok[c]["us"]) if ok else None
    if win is not None:
        configs[key] = tuple(int(v) for v in win.strip("()").split(","))
    print(label, win, round(ok[win]["us"], 2) if win else None, "cublas", round(table[base_name]["us"], 2),
          flush=True)  # fmt: skip
    return {"best": win, "best_us": ok[win]["us"] if win else None, "cublas_us": table[base_name]["us"],
            "all": table}  # fmt: skip


def _rows_limit(res: dict[str, Any], rows_list: tuple[int, ...], shapes: Any, floor: int) -> int:
    """The largest row count up to which the swept kernel beats its baseline, summed over the shapes, at every
    smaller row count too (`floor` where it never does)."""
    limit = floor
    for rows in rows_list:
        mine = sum(res[f"{nm} rows={rows}"]["best_us"] or 1e9 for nm in shapes)
        if mine >= sum(res[f"{nm} rows={rows}"]["cublas_us"] for nm in shapes):
            break
        limit = rows
    return limit


GEMM_ROWS = (5, 8, 16, 32, 64)


def _gemm_candidates(rows: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_M, BLOCK_K, warps) tiles of the blocked split-K kernel worth timing at `rows`."""
    bm = 16 if rows <= 16 else 64
    return [(64, bm, 128, 4), (64, bm, 256, 4), (32, bm, 128, 4), (32, bm, 256, 4), (128, bm, 128, 4),
            (128, bm, 128, 8), (64, bm, 512, 4), (16, bm, 256, 4)]  # fmt: skip


def gemm_section() -> dict[str, Any]:
    """Blocked INT4 tensor-core kernel tiles against dequantize + cuBLAS (and 4-row GEMVs for few rows) per
    seed-407m shape and row count; the winning tiles apply to later sections."""
    from tinyloop.kernels.cuda_backend import pdl_supported

    cuda_ops.USE_PDL = pdl_supported()
    res: dict[str, Any] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    old_max = cuda_ops.BLOCKED_GEMM_MAX_ROWS
    for name, (n, k, act) in SEED_SHAPES.items():
        ws = random_int4_copies(2 * n if act == 1 else n, k, gen)
        for rows in GEMM_ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

            def dequant_cublas(x: torch.Tensor = x, ws: list = ws, act: int = act) -> dict[str, float]:
                cuda_ops.BLOCKED_GEMM_MAX_ROWS = cuda_ops.MATVEC_MAX_ROWS
                return time_cycling(x, ws, act)

            cuda_ops.BLOCKED_GEMM_MAX_ROWS = 10**9
            res[f"{name} rows={rows}"] = _tile_sweep(f"{name} {rows}", x, ws, act, _gemm_candidates(rows),
                                                     cuda_ops.GEMM_CONFIGS, (n, k, rows),
                                                     ("dequant+cublas", dequant_cublas))  # fmt: skip
            cuda_ops.BLOCKED_GEMM_MAX_ROWS = old_max
        del ws
        torch.cuda.empty_cache()
    res["chosen_gemm"] = {str(k): v for k, v in cuda_ops.GEMM_CONFIGS.items()}
    # Later sections: the tensor-core kernel up to the largest row count where it beats dequantize + cuBLAS
    # summed over the shapes (and at every smaller row count).
    limit = _rows_limit(res, GEMM_ROWS, SEED_SHAPES, cuda_ops.MATVEC_MAX_ROWS)
    cuda_ops.BLOCKED_GEMM_MAX_ROWS = res["chosen_max_rows"] = limit
    print("BLOCKED_GEMM_MAX_ROWS", limit, flush=True)
    return res


INT4_GEMM_ROWS = (32, 64, 128)
INT4_GEMM_SHAPES = ("qkv", "out", "gate_up", "down")
PREFILL_ROWS = (64, 128)


def _int4_gemm_candidates(rows: int) -> list[tuple[int, int, int, int, int, int]]:
    """(BLOCK_N, BLOCK_M, BLOCK_K, warps, stages, splits) of `_gemm_blocked_int4_kernel` worth timing."""
    out = []
    for bm in sorted({min(64, rows), min(128, rows)}):
        out += [(64, bm, 128, 4, 3, 1), (64, bm, 128, 4, 3, 2), (64, bm, 128, 4, 3, 4), (64, bm, 64, 4, 4, 2),
                (128, bm, 128, 8, 3, 1), (128, bm, 128, 8, 3, 2), (128, bm, 64, 8, 3, 2), (64, bm, 256, 4, 2, 2),
                (128, bm, 64, 4, 3, 1), (64, bm, 128, 4, 4, 4)]  # fmt: skip
    return out


def _int4_gemm_checks() -> dict[str, float]:
    """The pipelined INT4 GEMM against float64 at a prefill's row counts: bf16 and float32, norm + SwiGLU."""
    gen = torch.Generator().manual_seed(5)
    res = {}
    for rows, group in ((128, 64), (100, 32), (64, 128)):
        q = quantize_int4(torch.randn(2 * 1536, 2048, generator=gen) / 45, group)
        w = BlockedInt4Weight.from_int4(q).to("cuda")
        x = torch.randn(rows, 2048, generator=gen)
        nw = 1 + 0.1 * torch.randn(2048, generator=gen)
        xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
        g, u = (xn @ q.dequantize().double().T).chunk(2, dim=-1)
        ref = torch.nn.functional.silu(g) * u
        for dtype in (torch.float32, torch.bfloat16):
            got = cuda_ops.fused_linear(x.to("cuda", dtype), w, norm_weight=nw.to("cuda", dtype), eps=1e-6,
                                        act=cuda_ops.ACT_SWIGLU)  # fmt: skip
            res[f"rows={rows} g{group} {str(dtype)[6:]} rel_frob"] = rel(got.float().cpu(), ref)
        limit, cuda_ops.INT4_GEMM_MAX_ROWS = cuda_ops.INT4_GEMM_MAX_ROWS, 0
        got = cuda_ops.fused_linear(x.to("cuda", torch.bfloat16), w, norm_weight=nw.to("cuda", torch.bfloat16),
                                    eps=1e-6, act=cuda_ops.ACT_SWIGLU)  # fmt: skip
        cuda_ops.INT4_GEMM_MAX_ROWS = limit
        res[f"rows={rows} g{group} bfloat16 dequantize+cuBLAS rel_frob"] = rel(got.float().cpu(), ref)
    return res


def _sweep_against_cublas(res: dict[str, Any], label: str, rows_list: tuple[int, ...],
                          switch: Callable[[bool], None], candidates: Callable[[int], list[tuple]], configs: dict,
                          key: Callable[[int, int, int, int], tuple[int, int, int]]) -> None:  # fmt: skip
    """Each seed-407m shape (INT4_GEMM_SHAPES) at each row count: the `candidates(rows)` tiles of a many-row INT4
    kernel (on with switch(True), tiles in configs[key(n, rows of the weight, k, rows)]) against cuBLAS on the
    already-dequantized 16-bit weight (what a prefill runs: the body is dequantized once per step), weights
    streamed from DRAM; each result in res["<shape> rows=<rows>"] (see _tile_sweep)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in INT4_GEMM_SHAPES:
        n, k, act = SEED_SHAPES[name]
        ws = random_int4_copies(2 * n if act == 1 else n, k, gen)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

            def cublas_on_dense(x: torch.Tensor = x, ws: list = ws, act: int = act) -> dict[str, float]:
                switch(False)
                with cuda_ops.dense_weights_reused(ws):
                    for w in ws:  # dequantized before the graph, as a prefill's first loop does
                        cuda_ops.fused_linear(x, w, act=act)
                    return time_cycling(x, ws, act)

            switch(True)
            res[f"{name} rows={rows}"] = _tile_sweep(f"{label} {name} {rows}", x, ws, act, candidates(rows), configs,
                                                     key(n, ws[0].shape[0], k, rows),
                                                     ("cublas_on_dense", cublas_on_dense))  # fmt: skip
        del ws
        torch.cuda.empty_cache()


def int4_gemm_section() -> dict[str, Any]:
    """`_gemm_blocked_int4_kernel` (INT4 words on tensor cores, 32-256 rows) per seed-407m shape: correctness
    against float64, tiles alone against cuBLAS on the already-dequantized 16-bit weight (what a prefill
    runs: the body is dequantized once per step), then seed-407m prefill end to end, fresh models with the
    kernel off and on alternated. The winning tiles and row limit apply to later sections."""
    from tinyloop.kernels.cuda_backend import pdl_supported

    cuda_ops.USE_PDL = pdl_supported()
    res: dict[str, Any] = {}
    old_limit = cuda_ops.INT4_GEMM_MAX_ROWS
    cuda_ops.INT4_GEMM_MAX_ROWS = 4096
    res["checks"] = _int4_gemm_checks()
    print("int4 gemm checks", {k: f"{v:.2e}" for k, v in res["checks"].items()}, flush=True)
    _sweep_against_cublas(res, "int4 gemm", INT4_GEMM_ROWS,
                          lambda on: setattr(cuda_ops, "INT4_GEMM_MAX_ROWS", 4096 if on else 0),
                          _int4_gemm_candidates, cuda_ops.INT4_GEMM_CONFIGS,
                          lambda n, n_total, k, rows: (n, k, rows))  # fmt: skip
    res["chosen"] = {str(k): v for k, v in cuda_ops.INT4_GEMM_CONFIGS.items()}
    limit = _rows_limit(res, INT4_GEMM_ROWS, INT4_GEMM_SHAPES, 0)
    res["limit_alone"] = limit
    # End to end: seed-407m score_last at PREFILL_ROWS tokens, loops 8, fresh models alternated.
    res.update(_prefill_on_off(lambda on: setattr(cuda_ops, "INT4_GEMM_MAX_ROWS", 4096 if on else 0), "int4_gemm",
                               PREFILL_ROWS))  # fmt: skip
    e2e = res["prefill_ms"]
    best = 0
    for n in PREFILL_ROWS:
        if min(e2e[f"int4_gemm=on {n}"]) < min(e2e[f"int4_gemm=off {n}"]):
            best = n
        else:
            break
    cuda_ops.INT4_GEMM_MAX_ROWS = res["chosen_max_rows"] = best if best else old_limit
    print("INT4_GEMM_MAX_ROWS", cuda_ops.INT4_GEMM_MAX_ROWS, flush=True)
    if cuda_ops.INT4_GEMM_MAX_ROWS:
        res["profile_128"] = _profile_prefill(128)
    return res


GLUON_GEMM_ROWS = (128, 1024)
# (BLOCK_M, BLOCK_N, warps, stages, split_k; 0: the launcher's split).
GLUON_GEMM_CANDIDATES = [(128, 64, 4, 4, 0), (128, 64, 8, 4, 0), (128, 64, 8, 6, 0), (64, 64, 8, 4, 0),
                         (128, 128, 8, 4, 0), (128, 64, 8, 4, 1), (256, 64, 8, 3, 0), (128, 128, 4, 4, 0)]  # fmt: skip
# (N, K, rows, bias, residual, dtype) of the Gluon INT4 GEMM's checks: seed-407m shapes, partial tiles in N and M.
BF16, FP16 = torch.bfloat16, torch.float16
GLUON_GEMM_CASES = [(6144, 2048, 128, False, False, BF16), (2048, 2048, 128, False, True, BF16),
                    (11264, 2048, 128, False, False, BF16), (2048, 5632, 300, False, True, BF16),
                    (1000, 1536, 77, True, False, BF16), (6144, 2048, 1024, False, False, FP16),
                    (2048, 2048, 128, False, True, FP16)]  # fmt: skip
# Tiles forced for the checks besides the launcher's default: K split 3 ways (uneven: 32 groups), two
# warpgroups along x's rows, along the weight's rows.
GLUON_GEMM_CHECK_TILES = [None, (128, 64, 8, 4, 3), (64, 128, 8, 4, 1), (128, 256, 8, 3, 0)]
# One Gluon INT4 GEMM call in a child process (a wrong barrier phase would hang, not fail).
GLUON_GEMM_SMOKE = """
import torch
from tinyloop.kernels import cuda_ops
from tinyloop.quant import BlockedInt4Weight, quantize_int4
cuda_ops.USE_GLUON_GEMM = True
q = quantize_int4(torch.randn(640, 1024) / 45, 64)
x = torch.randn(100, 1024).bfloat16()
y = cuda_ops._product(x.cuda(), BlockedInt4Weight.from_int4(q).to("cuda"), None, None, None)
torch.cuda.synchronize()
ref = x.double() @ q.dequantize().double().T
print("gluon gemm smoke ok", float((y.double().cpu() - ref).norm() / ref.norm()))
"""


def _gluon_gemm_checks() -> dict[str, dict[str, float]]:
    """`_product` through the Gluon INT4 GEMM (its default tile, then each GLUON_GEMM_CHECK_TILES tile) and
    through cuBLAS, each against float64 (no rounding on the way); split-K cases run twice (the workspace and
    counters must be back to zero after a call)."""
    gen = torch.Generator().manual_seed(7)
    res = {}
    for n, k, rows, bias, resid, dt in GLUON_GEMM_CASES:
        q = quantize_int4(torch.randn(n, k, generator=gen) / 45, 64)
        w = BlockedInt4Weight.from_int4(q).to("cuda")
        x = torch.randn(rows, k, generator=gen).to(dt)
        b = (0.1 * torch.randn(n, generator=gen)).to(dt) if bias else None
        r = torch.randn(rows, n, generator=gen).to(dt) if resid else None
        ref = x.double() @ q.dequantize().double().T
        ref = ref + (b.double() if b is not None else 0) + (r.double() if r is not None else 0)

        def product(x: torch.Tensor = x, w: BlockedInt4Weight = w, b: Any = b, r: Any = r) -> torch.Tensor:
            return cuda_ops._product(x.cuda(), w, None if b is None else b.cuda(), None if r is None else r.cuda(),
                                     None).double().cpu()  # fmt: skip

        cuda_ops.USE_GLUON_GEMM = False
        cublas = product()
        cuda_ops.USE_GLUON_GEMM = True
        key = (n, k, 1 << (rows - 1).bit_length())
        for tile in GLUON_GEMM_CHECK_TILES:
            if tile is None:
                cuda_ops.GLUON_GEMM_CONFIGS.pop(key, None)
            else:
                cuda_ops.GLUON_GEMM_CONFIGS[key] = tile
            got = [product() for _ in range(2)]
            name = f"{n}x{k} rows={rows} bias{int(bias)} res{int(resid)} {str(dt)[6:]} tile={tile or 'default'}"
            res[name] = {
                "gluon_vs_f64": rel(got[0], ref),
                "cublas_vs_f64": rel(cublas, ref),
                "gluon_vs_cublas": rel(got[0], cublas),
                "second_call_vs_first": rel(got[1], got[0]),
            }
            print("gluon gemm check", name, {c: f"{v:.2e}" for c, v in res[name].items()}, flush=True)
        cuda_ops.GLUON_GEMM_CONFIGS.pop(key, None)
    cuda_ops.USE_GLUON_GEMM = False
    return res


def gluon_gemm_section() -> dict[str, Any]:
    """The Gluon INT4 GEMM for short prefills (kernels/gluon_gemm_int4.py, cuda_ops.USE_GLUON_GEMM): one call in a
    child process, then against float64 and cuBLAS; tiles per seed-407m shape at 128 and 1,024 rows against
    cuBLAS on the already-dequantized 16-bit weight; seed-407m prefill (score_last, loops 8) end to end, fresh
    models with it off and on alternated. Where it wins end to end it stays on for later sections."""
    from tinyloop.kernels import gluon_gemm_int4
    from tinyloop.kernels.cuda_backend import pdl_supported

    cuda_ops.USE_PDL = pdl_supported()
    res: dict[str, Any] = {"available": gluon_gemm_int4.available() and torch.cuda.get_device_capability()[0] == 9}
    if not res["available"]:
        return res
    try:
        run = subprocess.run([sys.executable, "-c", GLUON_GEMM_SMOKE], capture_output=True, text=True, timeout=120)
        res["smoke"] = {"rc": run.returncode, "out": run.stdout[-500:], "err": run.stderr[-3000:]}
    except subprocess.TimeoutExpired:
        res["smoke"] = {"rc": "timeout"}
    print("gluon gemm smoke", res["smoke"], flush=True)
    if res["smoke"]["rc"] != 0:
        return res
    res["checks"] = _gluon_gemm_checks()
    cuda_ops.GLUON_GEMM_MAX_ROWS = 4096
    _sweep_against_cublas(res, "gluon gemm", GLUON_GEMM_ROWS, lambda on: setattr(cuda_ops, "USE_GLUON_GEMM", on),
                          lambda rows: GLUON_GEMM_CANDIDATES, cuda_ops.GLUON_GEMM_CONFIGS,
                          lambda n, n_total, k, rows: (n_total, k, 1 << (rows - 1).bit_length()))  # fmt: skip
    res["chosen"] = {str(k): v for k, v in cuda_ops.GLUON_GEMM_CONFIGS.items()}
    res.update(_prefill_on_off(lambda on: setattr(cuda_ops, "USE_GLUON_GEMM", on), "gluon_gemm", GLUON_GEMM_ROWS))
    e2e = res["prefill_ms"]
    wins = [n for n in GLUON_GEMM_ROWS if min(e2e[f"gluon_gemm=on {n}"]) < min(e2e[f"gluon_gemm=off {n}"])]
    cuda_ops.USE_GLUON_GEMM = bool(wins)
    cuda_ops.GLUON_GEMM_MAX_ROWS = max(wins) if wins else cuda_ops.GLUON_GEMM_MAX_ROWS
    res["chosen_on"], res["chosen_max_rows"] = cuda_ops.USE_GLUON_GEMM, cuda_ops.GLUON_GEMM_MAX_ROWS
    print("USE_GLUON_GEMM", cuda_ops.USE_GLUON_GEMM, "max rows", cuda_ops.GLUON_GEMM_MAX_ROWS, flush=True)
    if cuda_ops.USE_GLUON_GEMM:
        res["profile_128"] = _profile_prefill(128)
    return res


def _prefill_on_off(switch: Callable[[bool], None], label: str, rows: tuple[int, ...]) -> dict[str, Any]:
    """seed-407m score_last (loops 8) at each row count, fresh models with a kernel off and on (`switch`)
    alternated twice: ms per setting ("label=on 128") and the logits' distance on vs off."""
    wait_for_models(SEED_PATH)
    rng = np.random.default_rng(3)
    prompts = {n: rng.integers(0, 32000, n).astype(np.int32) for n in rows}
    e2e: dict[str, list[float]] = {}
    logits: dict[str, np.ndarray] = {}
    for _ in range(2):
        for on in (False, True):
            switch(on)
            m = tinyloop.Model(SEED_PATH, max_seq_len=1024, device="cuda")
            for n, ids in prompts.items():
                for _ in range(2):
                    out = m.score_last(ids, loops=8)
                logits[f"{on} {n}"] = np.asarray(out, dtype=np.float64)
                ms = 1e3 * statistics.median(timed(lambda ids=ids, m=m: m.score_last(ids, loops=8), 10))
                e2e.setdefault(f"{label}={'on' if on else 'off'} {n}", []).append(ms)
            m.close()
            torch.cuda.empty_cache()
    distance = {n: rel(logits[f"True {n}"], logits[f"False {n}"]) for n in rows}
    print(label, "prefill", {k: [round(v, 3) for v in vs] for k, vs in e2e.items()}, distance, flush=True)
    return {"prefill_ms": e2e, "prefill_logits_rel_on_vs_off": distance}


def _profile_prefill(tokens: int, path: str = SEED_PATH, seed: int = 3, top: int = 12) -> dict[str, Any]:
    """`_profile_calls` of a score_last of `tokens` tokens at loops 8 (the top kernels printed), with the call's
    median wall time over 10 unprofiled calls ("score_last_ms")."""
    m = tinyloop.Model(path, max_seq_len=1024, device="cuda")
    ids = np.random.default_rng(seed).integers(0, m.config["vocab_size"], tokens).astype(np.int32)
    for _ in range(2):
        m.score_last(ids, loops=8)
    ms = 1e3 * statistics.median(timed(lambda: m.score_last(ids, loops=8), 10))
    profile = _profile_calls(lambda: m.score_last(ids, loops=8), 5)
    m.close()
    torch.cuda.empty_cache()
    print(path, "prefill", tokens, round(ms, 3), "ms; wall / kernel us", round(profile["wall_us_per_call"], 1),
          round(profile["kernel_us_per_call"], 1), flush=True)  # fmt: skip
    for name, row in list(profile["kernels"].items())[:top]:
        print("   ", name, {a: round(b, 2) for a, b in row.items()}, flush=True)
    return {**profile, "score_last_ms": ms}


def _profile_calls(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    """Kernel time per call of fn by kernel name (torch profiler), against wall time per call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / calls
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name[:60], []).append(ev.device_time_total)
    table = {k: {"us_per_call": sum(v) / calls, "launches_per_call": len(v) / calls} for k, v in kernels.items()}
    busy = sum(v["us_per_call"] for v in table.values())
    return {"wall_us_per_call": wall * 1e6, "kernel_us_per_call": busy,
            "kernels": dict(sorted(table.items(), key=lambda kv: -kv[1]["us_per_call"])[:25])}  # fmt: skip


def prefill_profile_section() -> dict[str, Any]:
    """Where prefill time goes (seed-407m, loops 8, 128 and 1,024 tokens), and a speculative run's GPU
    busy time against its wall time (is speculation on the GPU bound by kernels or by the host?)."""
    wait_for_models(SEED_PATH)
    m = tinyloop.Model(SEED_PATH, max_seq_len=1024, device="cuda")
    rng = np.random.default_rng(2)
    out: dict[str, Any] = {}
    for n in (128, 1024):
        ids = rng.integers(0, 32000, n).astype(np.int32)
        for _ in range(2):
            m.score_last(ids, loops=8)
        out[f"prefill_{n}"] = _profile_calls(lambda ids=ids: m.score_last(ids, loops=8), 5)
    prompt = rng.integers(0, 32000, 64).astype(np.int32)
    run = lambda: m.generate_speculative(prompt, 64, draft_loops=2, verify_loops=8, temperature=0.0,  # noqa: E731
                                         adaptive=False)  # fmt: skip
    run()
    out["speculative_2_8_fixed_64_tokens"] = _profile_calls(run, 2)
    run = lambda: m.generate(prompt, 64, loops=8, temperature=0.0)  # noqa: E731
    run()
    out["plain_8_64_tokens"] = _profile_calls(run, 2)
    m.close()
    torch.cuda.empty_cache()
    for k, v in out.items():
        print(k, round(v["wall_us_per_call"], 1), round(v["kernel_us_per_call"], 1), flush=True)
        for name, row in list(v["kernels"].items())[:8]:
            print("   ", name, {a: round(b, 2) for a, b in row.items()}, flush=True)
    return out


def pdl_section() -> dict[str, Any]:
    """The INT4 GEMV back to back in a graph (weights streamed from DRAM), without and with programmatic
    dependent launch, at the tuned tiles."""
    res: dict[str, Any] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    old = cuda_ops.USE_PDL
    for name, (n, k, act) in SEED_SHAPES.items():
        ws = random_int4_copies(2 * n if act == 1 else n, k, gen)
        for rows in (1, 4):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            entry = {}
            for pdl in (False, True):
                cuda_ops.USE_PDL = pdl
                entry["pdl" if pdl else "plain"] = time_cycling(x, ws, act)
            res[f"{name} rows={rows}"] = entry
            print(name, rows, {k_: round(v["us"], 2) for k_, v in entry.items()}, flush=True)
        del ws
        torch.cuda.empty_cache()
    cuda_ops.USE_PDL = old
    return res


def _profile_decode(path: str, loops: int, tokens: int = 32) -> dict[str, Any]:
    """Kernel time per decode token by kernel name (torch profiler over graph replays), against wall time."""
    from torch.profiler import ProfilerActivity, profile

    m = tinyloop.Model(path, max_seq_len=512, device="cuda")
    prompt = np.random.default_rng(5).integers(0, m.config["vocab_size"], 128).astype(np.int32)
    for _ in range(2):
        m.generate(prompt, tokens, loops=loops, temperature=0.0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m.generate(prompt, tokens, loops=loops, temperature=0.0)
    wall = m.last_stats.decode_s / max(m.last_stats.generated_tokens - 1, 1)
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name[:60], []).append(ev.device_time_total)
    steps = tokens + 1
    table = {k: {"us_per_token": sum(v) / steps, "calls_per_token": len(v) / steps, "us_per_call": sum(v) / len(v)}
             for k, v in kernels.items()}  # fmt: skip
    m.close()
    torch.cuda.empty_cache()
    busy = sum(v["us_per_token"] for v in table.values())
    return {"wall_us_per_token": wall * 1e6, "kernel_us_per_token": busy,
            "kernels": dict(sorted(table.items(), key=lambda kv: -kv[1]["us_per_token"]))}  # fmt: skip


def profile_section() -> dict[str, Any]:
    """Kernel time per decode token of seed-407m (loops 8) with and without PDL (without, the kernels do not
    overlap, so their times add up to the step)."""
    wait_for_models(SEED_PATH)
    run = lambda: _profile_decode(SEED_PATH, 8)  # noqa: E731
    out = {
        "default": run(),
        "no_pdl": with_env({"TINYLOOP_DISABLE_PDL": "1"}, run),
    }
    for k, v in out.items():
        print(k, round(v["wall_us_per_token"], 1), round(v["kernel_us_per_token"], 1), flush=True)
        for name, row in list(v["kernels"].items())[:5]:
            print("   ", name, {a: round(b, 2) for a, b in row.items()}, flush=True)
    return out


# ---- seed-407m and Ouro benchmarks ------------------------------------------------------------------
def make_models() -> dict[str, subprocess.Popen]:
    procs = {}
    for preset, path in (("seed-407m", SEED_PATH), ("ouro-1.4b-shape", OURO_PATH)):
        if not Path(path).exists():
            procs[path] = (subprocess.Popen(
                [sys.executable, "-m", "tinyloop.cli.convert", "--random", "--preset", preset, "-o", path,
                 "--bits", "4"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            ))  # fmt: skip
    return procs


_PROCS: dict[str, subprocess.Popen] = {}


def wait_for_models(*paths: str) -> None:
    for path in paths or list(_PROCS):
        p = _PROCS.pop(path, None)
        if p is None:
            continue
        _, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"random model conversion failed: {err.decode()[-2000:]}")


def generation_numbers(path: str, loops: int, prompt_len: int = 128, new: int = 128, repeat: int = 5) -> dict:
    res: dict[str, Any] = {}
    rng = np.random.default_rng(1)
    m = tinyloop.Model(path, max_seq_len=1024, device="cuda")
    vocab = m.config["vocab_size"]
    prompt = rng.integers(0, vocab, prompt_len).astype(np.int32)
    for _ in range(2):
        m.generate(prompt, new, loops=loops, temperature=0.0)  # compiles, captures the decode graph
    totals, decodes, prefills = [], [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        m.generate(prompt, new, loops=loops, temperature=0.0)
        totals.append(time.perf_counter() - t)
        st = m.last_stats
        decodes.append(st.decode_s / max(st.generated_tokens - 1, 1) * new)
        prefills.append(st.prefill_s)
    res["generate_total_ms"] = 1e3 * statistics.median(totals)
    res["decode_128_tokens_ms"] = 1e3 * statistics.median(decodes)
    res["decode_tokens_per_s"] = new / statistics.median(decodes)
    res["prefill_in_generate_ms"] = 1e3 * statistics.median(prefills)
    # The decode step alone, no sampling sync between tokens (what the GPU is busy for).
    eng = m._engine
    cache = eng.new_cache(1, prompt_len + new + 8, loops)
    eng.step(torch.as_tensor(prompt[None], dtype=torch.long), cache, loops, last_only=True)
    tok = torch.tensor([[5]])

    def raw() -> None:
        cache.truncate(prompt_len)
        for _ in range(new):
            eng.step(tok, cache, loops, last_only=True)

    raw()
    res["raw_decode_128_ms"] = 1e3 * statistics.median(timed(raw, 5))
    for n in (128, 1024):
        ids = rng.integers(0, vocab, n).astype(np.int32)
        for _ in range(2):
            m.score_last(ids, loops=loops)
        res[f"prefill_{n}_ms"] = 1e3 * statistics.median(timed(lambda ids=ids: m.score_last(ids, loops=loops), 10))
    res["vram_usage_mb"] = m.vram_usage_mb()
    res["weights_mb"] = (
        sum(w.nbytes if isinstance(w, Int4Weight) else w.numel() * w.element_size() for w in _iter_weights(eng.weights))
        / 2**20
    )
    res["body_mb"] = sum(
        w.nbytes if isinstance(w, Int4Weight) else w.numel() * w.element_size()
        for lw in eng.weights.body for w in _iter_weights(lw)
    ) / 2**20  # fmt: skip
    m.close()
    torch.cuda.empty_cache()
    return res


def _iter_weights(obj: Any) -> list[Any]:
    from dataclasses import fields, is_dataclass

    seen: dict[int, Any] = {}

    def visit(o: Any) -> None:
        if isinstance(o, (torch.Tensor, Int4Weight)):
            seen[id(o)] = o
        elif isinstance(o, (tuple, list)):
            for v in o:
                visit(v)
        elif is_dataclass(o):
            for f in fields(o):
                visit(getattr(o, f.name))

    visit(obj)
    return list(seen.values())


def loops_curve(path: str, loops_list: tuple[int, ...]) -> dict[str, float]:
    m = tinyloop.Model(path, max_seq_len=256, device="cuda")
    prompt = np.random.default_rng(2).integers(0, m.config["vocab_size"], 64).astype(np.int32)
    out = {}
    for L in loops_list:
        m.generate(prompt, 16, loops=L, temperature=0.0)
        rates = []
        for _ in range(3):
            m.generate(prompt, 64, loops=L, temperature=0.0)
            rates.append(m.last_stats.decode_tokens_per_s)
        out[str(L)] = statistics.median(rates)
    m.close()
    torch.cuda.empty_cache()
    return out


def speculative_numbers(path: str, pairs: list[tuple[int, int]], new: int = 128) -> dict[str, Any]:
    m = tinyloop.Model(path, max_seq_len=512, device="cuda")
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, m.config["vocab_size"], 64).astype(np.int32)
    if m.config["vocab_size"] == 256:  # the built-in byte model: held-out-like code, where drafts are good
        prompt = np.frombuffer(b"import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n", np.uint8)
        prompt = prompt.astype(np.int32)
    out: dict[str, Any] = {}
    for d, v in pairs:
        plain = m.generate(prompt, new, loops=v, temperature=0.0)
        tp = statistics.median(timed(lambda v=v: m.generate(prompt, new, loops=v, temperature=0.0), 3))
        spec = m.generate_speculative(prompt, new, draft_loops=d, verify_loops=v, draft_ahead=4, temperature=0.0)
        ts = statistics.median(timed(
            lambda d=d, v=v: m.generate_speculative(prompt, new, draft_loops=d, verify_loops=v, temperature=0.0), 3
        ))  # fmt: skip
        fixed = m.generate_speculative(prompt, new, draft_loops=d, verify_loops=v, temperature=0.0, adaptive=False)
        tf = statistics.median(timed(lambda d=d, v=v: m.generate_speculative(
            prompt, new, draft_loops=d, verify_loops=v, temperature=0.0, adaptive=False), 3))  # fmt: skip
        out[f"{d},{v}"] = {
            "identical_to_plain": bool(np.array_equal(np.asarray(spec.tokens), np.asarray(plain))),
            "acceptance_rate": getattr(spec, "acceptance_rate", None),
            "tokens_per_verify": getattr(spec, "tokens_per_verify", None),
            "plain_steps": spec.stats.plain_steps,
            "prompt_agreement": spec.stats.prompt_agreement,
            "plain_tokens_per_s": new / tp,
            "speculative_tokens_per_s": new / ts,
            "fixed_k4": {
                "identical_to_plain": bool(np.array_equal(np.asarray(fixed.tokens), np.asarray(plain))),
                "acceptance_rate": fixed.acceptance_rate,
                "tokens_per_verify": fixed.tokens_per_verify,
                "tokens_per_s": new / tf,
            },
        }
        print("speculative", path, d, v, out[f"{d},{v}"], flush=True)
    m.close()
    torch.cuda.empty_cache()
    return out


def seed_section() -> dict[str, Any]:
    wait_for_models(SEED_PATH)
    res: dict[str, Any] = {"int4": generation_numbers(SEED_PATH, 8)}
    print("int4", res["int4"], flush=True)
    res["fp16_body"] = with_env({"TINYLOOP_EXPERIMENTAL_FP16_BODY": "1"}, lambda: generation_numbers(SEED_PATH, 8))
    print("fp16 body", res["fp16_body"], flush=True)
    res["decode_tokens_per_s_by_loops"] = loops_curve(SEED_PATH, (1, 2, 4, 8, 16))
    res["tiny_decode_tokens_per_s_by_loops"] = loops_curve("tiny", (1, 2, 4, 8, 16))
    res["speculative"] = speculative_numbers(SEED_PATH, [(2, 8), (4, 16)])
    res["tiny_speculative"] = speculative_numbers("tiny", [(1, 4), (2, 8), (4, 16)])
    return res


def speculative_section() -> dict[str, Any]:
    wait_for_models(SEED_PATH)
    return {
        "seed407m": speculative_numbers(SEED_PATH, [(2, 8), (4, 16)]),
        "tiny": speculative_numbers("tiny", [(1, 4), (2, 8), (4, 16)]),
    }


def ouro_section() -> dict[str, Any]:
    wait_for_models()
    return {"int4": generation_numbers(OURO_PATH, 4)}


def stochastic_section() -> dict[str, Any]:
    """Issue 9: decode speed with cross-iteration rounding kernels against plain INT4 (seed-407m)."""
    cmd = [sys.executable, "tools/bench_cross_iter_gpu.py", "--preset", "seed-407m", "--tokens", "128", "--loops", "8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return {"rc": p.returncode, "stdout": p.stdout[-6000:], "stderr": p.stderr[-3000:]}


def cli_section() -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tinyloop.cli.main", SEED_PATH, "benchmark", "--seq-len", "128", "--repeat", "5",
           "--decode", "32", "--json"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    prof = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "TINYLOOP_CUDA_PROFILE": "1"})  # fmt: skip
    return {"rc": p.returncode, "stdout": p.stdout[-4000:], "stderr": p.stderr[-2000:],
            "profile_stdout": prof.stdout[-4000:], "profile_stderr": prof.stderr[-1500:]}  # fmt: skip


# ---- session 13: L2 residency --------------------------------
def _driver_constants() -> dict[str, Any]:
    """The driver enum values kernels/l2_residency.py hard-codes, against the CUDA Python bindings' (if any)."""
    from tinyloop.kernels import l2_residency as l2

    ours = {
        "CU_LIMIT_PERSISTING_L2_CACHE_SIZE": l2._CU_LIMIT_PERSISTING_L2_CACHE_SIZE,
        "CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE": l2._CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
        "CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE": l2._CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE,
        "CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW": l2._CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW,
        "CU_ACCESS_PROPERTY_STREAMING": l2._CU_ACCESS_PROPERTY_STREAMING,
        "CU_ACCESS_PROPERTY_PERSISTING": l2._CU_ACCESS_PROPERTY_PERSISTING,
    }
    out: dict[str, Any] = {"ours": ours}
    try:
        try:
            from cuda.bindings import driver as cu  # type: ignore[import-not-found]
        except ImportError:
            from cuda import cuda as cu  # type: ignore[import-not-found,no-redef]
        theirs = {
            "CU_LIMIT_PERSISTING_L2_CACHE_SIZE": int(cu.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE),
            "CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE": int(
                cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE),
            "CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE": int(
                cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE),
            "CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW": int(
                cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW),
            "CU_ACCESS_PROPERTY_STREAMING": int(cu.CUaccessProperty.CU_ACCESS_PROPERTY_STREAMING),
            "CU_ACCESS_PROPERTY_PERSISTING": int(cu.CUaccessProperty.CU_ACCESS_PROPERTY_PERSISTING),
        }  # fmt: skip
        out["bindings"] = theirs
        out["agree"] = theirs == ours
    except Exception as exc:  # noqa: BLE001 - the bindings are optional on the device
        out["bindings_error"] = repr(exc)
    return out


def _graph_kernel_windows() -> dict[str, Any]:
    """Does a graph captured from a stream with an access-policy window keep it on its kernel nodes? A small
    torch graph captured from such a stream, its kernel nodes' window attribute read back."""
    import ctypes

    from tinyloop.kernels import l2_residency as l2

    drv = l2._driver()
    arena = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    l2.set_persisting_limit(4 << 20)
    window = l2.L2Window(arena.data_ptr(), arena.numel(), 1.0)
    stream = torch.cuda.Stream()
    x = torch.randn(256, 256, device="cuda")
    (x * 2 + 1) @ x  # initializes cuBLAS outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with l2.window_during(stream, window) as why:  # as the fused decoder captures
        back = l2.stream_window(stream)
        with torch.cuda.graph(graph, stream=stream):
            y = (x * 2 + 1) @ x
    after = l2.stream_window(stream)
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    drv.cuGraphGetNodes(raw, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    drv.cuGraphGetNodes(raw, nodes, ctypes.byref(count))
    kernels = []
    for node in nodes:
        kind = ctypes.c_int()
        drv.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            continue
        value = l2._StreamAttrValue()
        status = drv.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), ctypes.c_int(1), ctypes.byref(value))
        w = value.window
        kernels.append({"status": status, "base_matches": (w.base_ptr or 0) == window.base,
                        "num_bytes": int(w.num_bytes), "hit_ratio": float(w.hit_ratio)})  # fmt: skip
    graph.instantiate()
    graph.replay()
    torch.cuda.synchronize()
    ok = torch.allclose(y, (x * 2 + 1) @ x, rtol=1e-3, atol=1e-3)
    return {"refused": why, "stream_window_read_back": back == window, "stream_window_after": after.nbytes,
            "kernel_nodes": kernels, "replay_correct": bool(ok)}  # fmt: skip


def _reset_l2() -> None:
    """No persisting share and no persisting lines left from an earlier model (for a fair off run)."""
    from tinyloop.kernels import l2_residency as l2

    torch.cuda.synchronize()
    l2.drop_persisting_share()


# (label, TINYLOOP_DISABLE_L2_RESIDENCY, l2_residency.SHARE_OFF_DURING_PREFILL) of _l2_ab's models.
L2_VARIANTS = (("off", "1", False), ("on", "0", False), ("on+share_off", "0", True))


def _l2_ab(path: str, rounds: int = 2, partial: bool = False) -> dict[str, Any]:
    """Fresh models of `path` with L2 residency off (TINYLOOP_DISABLE_L2_RESIDENCY), on, and on with the
    persisting share given up during each prefill, alternated: 64 raw decode steps at 8 loops after a 128-token
    prompt (ms), the window each got, 32 greedy tokens, then prefills of 128 and 1,024 tokens after decode."""
    from tinyloop.kernels import l2_residency as l2
    from tinyloop.runtime.fused_decode import FusedDecoder

    l2.PARTIAL_WINDOW = partial
    out: dict[str, Any] = {"ms": {}, "window": {}, "tokens_equal": None, "capture_stream_window_after": None}
    tokens: dict[str, list[int]] = {}
    for _ in range(rounds):
        for label, flag, release in L2_VARIANTS:
            l2.SHARE_OFF_DURING_PREFILL = release
            env = {"TINYLOOP_DISABLE_L2_RESIDENCY": flag}
            _reset_l2()
            m = with_env(env, lambda: tinyloop.Model(path, max_seq_len=1024, device="cuda"))
            eng = m._engine
            vocab = m.config["vocab_size"]
            prompt = torch.as_tensor(np.random.default_rng(4).integers(0, vocab, (1, 128)), dtype=torch.long)
            cache = eng.new_cache(1, 260, 8)
            eng.step(prompt, cache, 8, last_only=True)
            tok = torch.tensor([[5]])

            def raw(cache: Any = cache, eng: Any = eng, tok: Any = tok) -> None:
                cache.truncate(128)
                for _ in range(64):
                    eng.step(tok, cache, 8, last_only=True)

            raw()
            out["ms"].setdefault(label, []).append(1e3 * statistics.median(timed(raw, 5)))
            w = eng.l2_window
            out["window"][label] = None if w is None else {"nbytes": w.nbytes, "hit_ratio": w.hit_ratio}
            dec = eng.decoder
            if label == "on" and w is not None and isinstance(dec, FusedDecoder) and dec._stream is not None:
                out["capture_stream_window_after"] = l2.stream_window(dec._stream).nbytes  # 0: cleared
                out["persisting_limit"] = l2.persisting_limit()
            print(path, label, "generate", flush=True)  # names the run if a capture fails
            tokens[label] = [int(t) for t in m.generate(prompt[0].numpy(), 32, loops=8, temperature=0.0)]
            for n in (128, 1024):  # prefill after decode graphs ran (persisting lines in L2)
                ids = np.random.default_rng(n).integers(0, vocab, n).astype(np.int32)
                m.score_last(ids, loops=8)

                seconds, step_seconds = [], []
                for _ in range(10):  # a decode step after each prefill, as in use (it takes the share back)
                    step_seconds += timed(lambda c=cache, e=eng, t=tok: e.step(t, c, 8, last_only=True), 1)
                    cache.truncate(128)
                    seconds += timed(lambda ids=ids, m=m: m.score_last(ids, loops=8), 1)
                ms = 1e3 * statistics.median(seconds)
                step_ms = 1e3 * statistics.median(step_seconds)
                out.setdefault("decode_step_after_prefill_ms", {}).setdefault(f"{label} {n}", []).append(step_ms)
                out.setdefault("prefill_ms", {}).setdefault(f"{label} {n}", []).append(ms)
            m.close()
            torch.cuda.empty_cache()
    out["tokens_equal"] = tokens["on"] == tokens["off"] == tokens["on+share_off"]
    l2.PARTIAL_WINDOW = False
    l2.SHARE_OFF_DURING_PREFILL = False
    _reset_l2()
    print(path, "L2", out, flush=True)
    return out


def l2_section() -> dict[str, Any]:
    """L2 residency (kernels/l2_residency.py): driver constants, the device's limits, graph kernel nodes
    keeping the capture stream's window, the level-1 lines, and decode off vs on for the built-in model, a
    one-body-layer seed-407m (fits), and seed-407m itself with a partial window."""
    import dataclasses

    from tinyloop.convert.random_model import write_random_model
    from tinyloop.kernels import l2_residency as l2
    from tinyloop.presets import preset

    res: dict[str, Any] = {"constants": _driver_constants()}
    res["limits"] = dict(zip(("max_persisting", "max_window"), l2.device_limits(torch.device("cuda")), strict=True))
    res["graph_nodes"] = _graph_kernel_windows()
    print("L2", res, flush=True)
    one_body = "/tmp/seed-1body.tinyloop"
    if not Path(one_body).exists():
        cfg = dataclasses.replace(preset("seed-407m"), n_body=1, name="seed-1body")
        write_random_model(Path(one_body), cfg, 0, 4, 64, progress=False)
    wait_for_models(SEED_PATH)
    lines = {}
    for path in ("tiny", one_body, SEED_PATH):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            tinyloop.Model(path, max_seq_len=256, device="cuda").close()
        lines[path] = [ln for ln in err.getvalue().splitlines() if "L2" in ln or "weights on GPU" in ln]
        _reset_l2()
    res["log_lines"] = lines
    print(lines, flush=True)
    res["tiny"] = _l2_ab("tiny")
    res["seed_1body"] = _l2_ab(one_body, rounds=3)
    res["seed407m_partial"] = _l2_ab(SEED_PATH, partial=True)
    return res


def prefill_blas_section() -> dict[str, Any]:
    """seed-407m prefill (128 and 1,024 tokens, loops 8) with the GEMMs through cuBLAS (torch's default) against
    cuBLASLt as torch's preferred BLAS library (its own heuristics for short, wide products), fresh models
    alternated twice; then where a 128-token prefill's kernel time goes with the default."""
    before = torch.backends.cuda.preferred_blas_library()

    def switch(on: bool) -> None:
        torch.backends.cuda.preferred_blas_library("cublaslt" if on else before)

    try:
        out = _prefill_on_off(switch, "cublaslt", (128, 1024))
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    out["default_library"] = str(before)
    out["profile_128"] = _profile_prefill(128)
    return out


def tiny_prefill_section() -> dict[str, Any]:
    """Where the built-in model's prefill time goes (loops 8, 128 and 1,024 tokens; torch profiler over graph
    replays), with its score_last wall time: its layers are 13x smaller than seed-407m's, yet session 13 measured
    its prefill of 1,024 tokens slower (9.5 against 7.8 ms)."""
    out: dict[str, Any] = {}
    for n in (128, 1024):
        profile = _profile_prefill(n, "tiny", seed=5, top=14)
        out[f"ms_{n}"] = profile.pop("score_last_ms")
        out[f"profile_{n}"] = profile
    return out


def headline_section() -> dict[str, Any]:
    """The issue table's rows (seed-407m INT4 at 8 loops; Ouro-1.4B's shape at 4 loops) with current defaults."""
    wait_for_models()
    return {"seed407m": generation_numbers(SEED_PATH, 8), "ouro": generation_numbers(OURO_PATH, 4)}


SECTIONS = {
    "env": env_section,
    "correctness": correctness_section,
    "quick_correctness": quick_correctness_section,
    "sweep": sweep_section,
    "pdl": pdl_section,
    "gemm": gemm_section,
    "int4_gemm": int4_gemm_section,
    "tiny_split": tiny_split_section,
    "staged_mma": staged_mma_section,
    "staged_mma_timeline": staged_mma_timeline_section,
    "launch_placement": launch_placement_section,
    "gluon_gemm": gluon_gemm_section,
    "prefill_profile": prefill_profile_section,
    "profile": profile_section,
    "seed407m": seed_section,
    "ouro": ouro_section,
    "cli": cli_section,
    "stochastic": stochastic_section,
    "speculative": speculative_section,
    "chain_tiles": chain_tiles_section,
    "pdl_early": pdl_early_section,
    "maxnreg": maxnreg_section,
    "gluon": gluon_section,
    "gluon_chain": gluon_chain_section,
    "staged": staged_section,
    "attention_split": attention_split_section,
    "staged_policy": staged_policy_section,
    "timeline": timeline_section,
    "tiny_gemv": tiny_gemv_section,
    "l2": l2_section,
    "headline": headline_section,
    "prefill_blas": prefill_blas_section,
    "tiny_prefill": tiny_prefill_section,
}


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", default=list(SECTIONS))
    ap.add_argument("--configs", help="JSON file of chosen GEMV tiles (an earlier sweep's chosen_matvec)")
    ap.add_argument("--quick", action="store_true", help="quick_correctness without seed-407m on the CPU")
    args = ap.parse_args()
    OUT = Path(args.out)
    global FULL
    FULL = not args.quick
    _PROCS.update(make_models())
    if args.configs:
        for key, cfg in json.loads(Path(args.configs).read_text()).items():
            cuda_ops.BLOCKED_CONFIGS[tuple(int(v) for v in key.strip("()").split(","))] = tuple(cfg)  # type: ignore[index]
    for name in args.only:
        section(name, SECTIONS[name])
    wait_for_models()


if __name__ == "__main__":
    main()
