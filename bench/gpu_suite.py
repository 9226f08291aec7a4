"""The GPU suite: today's GPU benchmarks of docs/BENCHMARKS.md in one device call.

    PYTHONPATH=src python3 bench/gpu_suite.py --out $OUT/gpu_suite.json [--only SECTION ...] [--quick]

Sections: env (device, versions, copy bandwidth), correctness (GPU against the CPU float32 path: the built-in model
in every dtype and attention switch, seed-407m in bf16 and float32, the Ouro shape in float32), quick_correctness
(the INT4 kernels against float64, the built-in model, seed-407m in float32 unless --quick), headline (seed-407m
INT4 at 8 loops and the Ouro-1.4B shape at 4 loops: decode 128 after 128, prefill 128 / 1,024, VRAM), seed407m
(headline's seed-407m row, the fp16 body, decode tokens/s against loops, self-speculative decoding), ouro,
speculative, profile (kernel time per decode token, PDL on and off), timeline (one decode step's kernels in order,
PDL on and off), prefill_profile, tiny_prefill (the built-in model's float32 prefill), l2 (L2 residency off against
on), stochastic (cross-iteration rounding kernels, bench/cross_iter_gpu.py), cli (`tinyloop FILE benchmark`).
Every section saves the JSON so far; a failing section records its traceback and the rest still run.
Random-weight models are written to /tmp on first use (tinyloop-convert --random).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from cuda_timing import timed
from gpu_check import rel, teacher_forced

import tinyloop
from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_backend, cuda_ops
from tinyloop.kernels.cuda_backend import kernel_policy
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


@contextlib.contextmanager
def policy_overrides(fields: dict) -> Iterator[None]:
    """Models loaded inside build their KernelPolicy with `fields` replaced (the loader's policy factory wrapped:
    the policy stays a value built at load)."""
    if not fields:
        yield
        return
    built = cuda_backend.kernel_policy
    with mock.patch.object(cuda_backend, "kernel_policy", lambda env: dataclasses.replace(built(env), **fields)):
        yield


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
def compare_model(path: str, ids: np.ndarray, loops: int, greedy_prompts: list[np.ndarray], **gpu_kw: Any) -> dict:
    cpu = tinyloop.Model(path, max_seq_len=512, device="cpu")
    gpu = tinyloop.Model(path, max_seq_len=512, device="cuda", **gpu_kw)
    res: dict[str, Any] = {}
    res["prefill_rel_frob"] = rel(gpu.score(ids, loops=loops), cpu.score(ids, loops=loops))
    res["short_prefill_rel_frob"] = rel(gpu.score(ids[:12], loops=loops), cpu.score(ids[:12], loops=loops))
    c = teacher_forced(cpu, ids, 64, 24, loops)
    g = teacher_forced(gpu, ids, 64, 24, loops)
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
    # Sandwich norms, exit gates, no prelude or coda: the paths seed-407m (pre-norm) never takes.
    wait_for_models(OURO_PATH)
    oid = rng.integers(0, 49152, 160).astype(np.int32)
    res["ouro_shape_f32"] = compare_model(OURO_PATH, oid, 4, [oid[:16]], dtype=torch.float32)
    return res


FULL = True  # quick_correctness also runs seed-407m on the CPU (about a minute)


def quick_correctness_section() -> dict[str, Any]:
    """The kernels' agreement with the CPU after a kernel change: built-in model, seed-407m in float32."""
    wait_for_models(SEED_PATH)
    prompts = [np.frombuffer(p.encode(), dtype=np.uint8).astype(np.int32) for p in ("def f(", "class Stack:\n  ")]
    ids = np.frombuffer(b"import os\n" * 30, dtype=np.uint8).astype(np.int32)
    sid = np.random.default_rng(0).integers(0, 32000, 120).astype(np.int32)
    kernels = {}
    policy = kernel_policy(RuntimeEnv.read())  # what a CUDA engine here would run
    gen = torch.Generator().manual_seed(0)
    for rows, group in ((1, 64), (2, 64), (4, 64), (1, 32), (3, 128), (5, 64), (8, 64), (12, 64)):
        raw = torch.randn(2 * 1536, 2048, generator=gen) / 45
        q = quantize_int4(raw, group).to("cuda")
        x = torch.randn(rows, 2048, generator=gen)
        nw = 1 + 0.1 * torch.randn(2048, generator=gen)
        xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
        g, u = (xn @ q.dequantize().cpu().double().T).chunk(2, dim=-1)
        for layout, w in (("plain", q), ("blocked", BlockedInt4Weight.from_int4(q))):
            got = cuda_ops.fused_linear(policy, x.cuda(), w, norm_weight=nw.cuda(), eps=1e-6, act=cuda_ops.ACT_SWIGLU)
            kernels[f"rows={rows} g{group} {layout} f32 rel_frob"] = rel(got.cpu(), torch.nn.functional.silu(g) * u)
    # bf16 through the blocked tensor-core kernel (the CPU interpreter cannot check bf16 tl.dot)
    for rows, group in ((5, 64), (16, 32), (9, 128)):
        raw = torch.randn(2048, 2048, generator=gen) / 45
        q = quantize_int4(raw, group)
        x = torch.randn(rows, 2048, generator=gen).bfloat16()
        got = cuda_ops.fused_linear(policy, x.cuda(), BlockedInt4Weight.from_int4(q).to("cuda"))
        ref = x.double() @ q.dequantize().double().T
        kernels[f"rows={rows} g{group} blocked bf16 rel_frob"] = rel(got.float().cpu(), ref)
    return {
        "int4_kernels_vs_float64": kernels,
        "tiny_default_dtype": compare_model("tiny", ids, 8, prompts),
        "seed407m_f32": compare_model(SEED_PATH, sid, 8, [sid[:16]], dtype=torch.float32) if FULL else None,
    }


RAW_DECODE_PROMPT = torch.as_tensor(np.random.default_rng(4).integers(0, 32000, (1, 128)), dtype=torch.long)


def timeline_by_kernel(timeline: dict[str, Any]) -> dict[str, list[float]]:
    """A step timeline's kernels grouped by name: [launches, mean µs from launch to end, mean µs the kernel adds
    to the step (its end minus the previous kernel's end: under PDL a kernel starts early and waits, so its
    duration overlaps its predecessor's)]."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for name, us, gap in timeline["step"][1:]:
        groups.setdefault(name, []).append((us, us + gap))
    return {name: [len(v), round(statistics.mean(d for d, _ in v), 2), round(statistics.mean(a for _, a in v), 2)]
            for name, v in groups.items()}  # fmt: skip


def step_timeline(pdl: bool, path: str = SEED_PATH, loops: int = 8, rows: int = 1) -> dict[str, Any]:
    """Kernels of one raw decode step of `rows` sequences (default: seed-407m, loops 8, one row; position 160
    of 64 profiled steps after a 128-token prompt) in launch order: name, duration and the gap since the previous
    kernel ended (negative: overlap under PDL)."""
    from torch.profiler import ProfilerActivity, profile

    def run() -> dict[str, Any]:
        m = tinyloop.Model(path, max_seq_len=512, device="cuda")
        eng, steps = m._engine, 64
        cache = eng.new_cache(rows, 260, loops)
        eng.step(RAW_DECODE_PROMPT.repeat(rows, 1), cache, loops, last_only=True)
        tok = torch.full((rows, 1), 5)
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
    """One decode step's kernels in order, with and without PDL (see step_timeline), and grouped by name
    (bench/render_gpu_report.py --step-plot draws the groups)."""
    wait_for_models(SEED_PATH)
    res = {"pdl": step_timeline(True), "no_pdl": step_timeline(False)}
    for k, v in res.items():
        v["by_kernel"] = timeline_by_kernel(v)
        print("timeline", k, v["kernels_per_step"], round(v["step_span_us"], 1), round(v["step_busy_us"], 1),
              round(v["step_gaps_us"], 1))  # fmt: skip
        for row in v["step"][:24]:
            print("   ", row, flush=True)
    return res


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


def decode_timing(m: Any, prompt: np.ndarray, loops: int, new: int = 128, repeat: int = 5) -> dict[str, Any]:
    """Greedy `generate` of `new` tokens after `prompt` (median of `repeat` after two warm-ups) and the decode
    step alone without the per-token sampling sync (what the GPU is busy for); the greedy tokens too."""
    res: dict[str, Any] = {}
    for _ in range(2):
        m.generate(prompt, new, loops=loops, temperature=0.0)  # compiles, captures the decode graph
    totals, decodes, prefills = [], [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        greedy = m.generate(prompt, new, loops=loops, temperature=0.0)
        totals.append(time.perf_counter() - t)
        st = m.last_stats
        decodes.append(st.decode_s / max(st.generated_tokens - 1, 1) * new)
        prefills.append(st.prefill_s)
    res["generate_total_ms"] = 1e3 * statistics.median(totals)
    res["decode_128_tokens_ms"] = 1e3 * statistics.median(decodes)
    res["decode_tokens_per_s"] = new / statistics.median(decodes)
    res["prefill_in_generate_ms"] = 1e3 * statistics.median(prefills)
    res["greedy"] = [int(t) for t in greedy]
    eng = m._engine
    prompt_len = len(prompt)
    cache = eng.new_cache(1, prompt_len + new + 8, loops)
    eng.step(torch.as_tensor(prompt[None], dtype=torch.long), cache, loops, last_only=True)
    tok = torch.tensor([[5]])

    def raw() -> None:
        cache.truncate(prompt_len)
        for _ in range(new):
            eng.step(tok, cache, loops, last_only=True)

    raw()
    res["raw_decode_128_ms"] = 1e3 * statistics.median(timed(raw, 5))
    return res


def generation_numbers(path: str, loops: int, prompt_len: int = 128, new: int = 128, repeat: int = 5) -> dict:
    rng = np.random.default_rng(1)
    m = tinyloop.Model(path, max_seq_len=1024, device="cuda")
    vocab = m.config["vocab_size"]
    prompt = rng.integers(0, vocab, prompt_len).astype(np.int32)
    res = decode_timing(m, prompt, loops, new, repeat)
    eng = m._engine
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
    """Decode speed with cross-iteration rounding kernels against plain INT4 (seed-407m)."""
    cmd = [sys.executable, "bench/cross_iter_gpu.py", "--preset", "seed-407m", "--tokens", "128", "--loops", "8"]
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


def _l2_ab(path: str, rounds: int = 2) -> dict[str, Any]:
    """Fresh models of `path` with L2 residency off (TINYLOOP_DISABLE_L2_RESIDENCY=1) and on, alternated: 64 raw
    decode steps at 8 loops after a 128-token prompt (ms), the window each got, 32 greedy tokens, then prefills
    of 128 and 1,024 tokens, each right after a decode step (as in use)."""
    from tinyloop.kernels import l2_residency as l2
    from tinyloop.runtime.fused_decode import FusedDecoder

    out: dict[str, Any] = {"ms": {}, "window": {}, "tokens_equal": None, "capture_stream_window_after": None}
    tokens: dict[str, list[int]] = {}
    for _ in range(rounds):
        for label, flag in (("off", "1"), ("on", "0")):
            _reset_l2()
            m = with_env({"TINYLOOP_DISABLE_L2_RESIDENCY": flag},
                         lambda: tinyloop.Model(path, max_seq_len=1024, device="cuda"))  # fmt: skip
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
            for n in (128, 1024):
                ids = np.random.default_rng(n).integers(0, vocab, n).astype(np.int32)
                m.score_last(ids, loops=8)
                seconds = []
                for _ in range(10):
                    timed(lambda c=cache, e=eng, t=tok: e.step(t, c, 8, last_only=True), 1)
                    cache.truncate(128)
                    seconds += timed(lambda ids=ids, m=m: m.score_last(ids, loops=8), 1)
                out.setdefault("prefill_ms", {}).setdefault(f"{label} {n}", []).append(1e3 * statistics.median(seconds))
            m.close()
            torch.cuda.empty_cache()
    out["tokens_equal"] = tokens["on"] == tokens["off"]
    _reset_l2()
    print(path, "L2", out, flush=True)
    return out


def l2_section() -> dict[str, Any]:
    """L2 residency (kernels/l2_residency.py): driver constants, the device's limits, graph kernel nodes
    keeping the capture stream's window, the level-1 lines, and off against on for the built-in model and a
    one-body-layer seed-407m (both fit the persisting share; seed-407m itself does not)."""
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
    return res


def tiny_prefill_section() -> dict[str, Any]:
    """Where the built-in model's prefill time goes (loops 8, 128 and 1,024 tokens; torch profiler over graph
    replays), with its score_last wall time: its layers are 13x smaller than seed-407m's, yet its float32 prefill
    of 1,024 tokens is slower."""
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
    "headline": headline_section,
    "seed407m": seed_section,
    "ouro": ouro_section,
    "speculative": speculative_section,
    "profile": profile_section,
    "timeline": timeline_section,
    "prefill_profile": prefill_profile_section,
    "tiny_prefill": tiny_prefill_section,
    "l2": l2_section,
    "stochastic": stochastic_section,
    "cli": cli_section,
}


def main() -> None:
    global OUT, FULL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file of every section's numbers (written after each)")
    ap.add_argument("--only", nargs="*", default=list(SECTIONS), choices=list(SECTIONS), metavar="SECTION")
    ap.add_argument("--quick", action="store_true", help="quick_correctness without seed-407m on the CPU")
    args = ap.parse_args()
    OUT = Path(args.out)
    FULL = not args.quick
    _PROCS.update(make_models())
    for name in args.only:
        section(name, SECTIONS[name])
    wait_for_models()


if __name__ == "__main__":
    main()
