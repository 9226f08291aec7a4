"""Timing a model: repeated forward scoring of synthetic tokens, cached decoding, and (profile mode) the
time of each stage and of attention against matrix work. Used by `tinyloop <model> benchmark` and bench/.

Works on an Engine; `tinyloop.cli.benchmark_cmd.benchmark_file` loads a file the way `Model` does (every
TINYLOOP_* switch applied) and measures it.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinyloop.cache.memory import check_host_memory
from tinyloop.config import ArchConfig
from tinyloop.env import RuntimeEnv
from tinyloop.format.header import ModelHeader
from tinyloop.layout import parameter_count
from tinyloop.model.looped import embed, exit_hidden, gate_logit, head, initial_state, loop_iteration, run_prelude
from tinyloop.model.weights import weight_bytes
from tinyloop.quant import CpuInt4Weight
from tinyloop.runtime.engine import Engine, cpu_threads_for

# Profiler op / kernel names by the kind of work they do (matched as lowercase substrings; attention first,
# so an attention kernel that contains "gemm" still counts as attention).
ATTENTION_NAMES = ("attention", "attn", "flash", "fmha", "sdpa", "softmax")
MATRIX_NAMES = ("linear", "addmm", "matmul", "mm", "gemm", "gemv", "int4", "int8", "cublas", "cutlass")


@dataclass(frozen=True)
class BenchmarkConfig:
    """What to measure. decode=0 measures scoring only; profile=True skips warm-up and times segments."""

    loops: int = 8
    seq_len: int = 512
    repeat: int = 20
    batch: int = 1
    decode: int = 0
    decode_repeat: int = 3
    seed: int = 0
    profile: bool = False

    def check(self, cfg: ArchConfig) -> None:
        """ValueError naming the option when a value is out of range for this model."""
        for name in ("loops", "seq_len", "repeat", "batch", "decode_repeat"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("decode", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.seq_len > cfg.max_position:
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's maximum position {cfg.max_position}")
        if self.seq_len + self.decode > cfg.max_position:
            raise ValueError(
                f"seq_len {self.seq_len} + decode {self.decode} exceeds the model's maximum position {cfg.max_position}"
            )


@dataclass(frozen=True)
class Latency:
    """Wall times of repeated runs, in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    runs: int

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        ms = [1e3 * s for s in seconds]
        return cls(statistics.median(ms), min(ms), max(ms), len(ms))


@dataclass(frozen=True)
class DecodeResult:
    """Prefill of seq_len tokens per row, then `tokens` cached decode steps (one new token per row each)."""

    tokens: int
    prefill: Latency
    decode: Latency  # all decode steps of one run
    batch: int

    @property
    def ms_per_token(self) -> float:
        """Milliseconds per decode step (each step yields one token in every row)."""
        return self.decode.median_ms / self.tokens

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.tokens / (self.decode.median_ms / 1e3)


@dataclass
class BenchmarkResult:
    device: str
    device_name: str
    torch_version: str
    threads: int
    model: dict[str, Any]
    quantization: dict[str, Any]
    config: BenchmarkConfig
    warmup: bool
    forward: Latency
    switches: dict[str, Any] = field(default_factory=dict)  # TINYLOOP_* settings in effect (non-default)
    not_applied: list[str] = field(default_factory=list)  # TINYLOOP_* variables set that this run ignores
    decode: DecodeResult | None = None
    segments: dict[str, Latency] = field(default_factory=dict)  # profile mode, in execution order
    work: dict[str, float] = field(default_factory=dict)  # profile mode: ms of attention / matrix / other

    @property
    def forward_tokens_per_s(self) -> float:
        return self.config.batch * self.config.seq_len / (self.forward.median_ms / 1e3)

    def to_dict(self) -> dict[str, Any]:
        """Every number, JSON-ready: config keys at the top level, results under forward / decode."""
        b = self.config
        out: dict[str, Any] = {
            "device": self.device,
            "device_name": self.device_name,
            "torch_version": self.torch_version,
            "threads": self.threads,
            "model": self.model,
            "quantization": self.quantization,
            "loops": b.loops,
            "seq_len": b.seq_len,
            "batch": b.batch,
            "repeat": b.repeat,
            "decode_tokens": b.decode,
            "decode_repeat": b.decode_repeat,
            "seed": b.seed,
            "profile": b.profile,
            "warmup": self.warmup,
            "switches": dict(self.switches),
            "not_applied": list(self.not_applied),
            "forward": {**asdict(self.forward), "tokens_per_s": self.forward_tokens_per_s},
            "decode": None,
        }
        if self.decode is not None:
            d = self.decode
            out["decode"] = {
                "tokens": d.tokens,
                "prefill": asdict(d.prefill),
                "decode": asdict(d.decode),
                "ms_per_token": d.ms_per_token,
                "tokens_per_s": d.tokens_per_s,
            }
        if b.profile:
            out["segments"] = {name: asdict(lat) for name, lat in self.segments.items()}
            out["work_ms"] = dict(self.work)
        return out


# ---- measuring ----------------------------------------------------------------------------------


# RuntimeEnv switches that only some timings apply: the forward scoring runs every loop (no token-stable
# early exit) and holds no KV cache; the decode timing generates through the Model, in its KV mode.
SCORING_EXIT_SWITCHES = ("token_exit", "token_exit_verbose")
KV_SWITCHES = ("disable_kv_cache", "kv_int8", "kv_h_mode")


def unapplied_switches(bench: BenchmarkConfig) -> tuple[str, ...]:
    """The RuntimeEnv fields this benchmark run leaves without effect."""
    return SCORING_EXIT_SWITCHES + (() if bench.decode else KV_SWITCHES)


def forward_bytes(cfg: ArchConfig, batch: int, seq_len: int, dtype: torch.dtype) -> int:
    """Fewest bytes one forward pass over batch x seq_len tokens holds at once: one layer's activations
    (loop state, residual, normed input, attention output, QKV, three FFN buffers) and float32 logits."""
    elt = torch.empty((), dtype=dtype).element_size()
    per_token = (4 * cfg.d_model + cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.ffn_dim) * elt + 4 * cfg.vocab_size
    return batch * seq_len * per_token


def synthetic_tokens(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Seeded random ids [batch, length] in [1, vocab): never all zero (a zero row can hide bugs)."""
    gen = torch.Generator().manual_seed(seed)
    low = 1 if vocab_size > 1 else 0
    return torch.randint(low, vocab_size, (batch, length), generator=gen, dtype=torch.long)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(engine: Engine, tokens: torch.Tensor, loops: int) -> float:
    """Seconds for one scoring forward (logits at every position), as `Model.score` runs it."""
    synchronize(engine.device)
    t0 = time.perf_counter()
    engine.step(tokens, None, loops)
    synchronize(engine.device)
    return time.perf_counter() - t0


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.segments: dict[str, float] = {}
        synchronize(device)
        self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.segments[name] = now - self.last
        self.last = now


@torch.inference_mode()
def segmented_forward(engine: Engine, tokens: torch.Tensor, loops: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The scoring forward of `Engine.step` (no cache), stage by stage with the device synchronised in
    between: (logits [B, T, V], seconds per segment: embedding, prelude, loop 1..L, coda, head)."""
    cfg, w, device = engine.cfg, engine.weights, engine.device
    B, T = tokens.shape
    ids = tokens.to(device)
    positions = torch.arange(T, device=device).expand(B, T)
    ctx = engine.context(positions, None, None)
    clock = _Clock(device)
    with cpu_threads_for(device, B * T):
        x = embed(w, cfg, ids, engine.dtype)
        clock.mark("embedding")
        p = run_prelude(w, cfg, x, ctx)
        s = initial_state(cfg, p, ctx.positions, engine.noise)
        clock.mark("prelude")
        for t in range(loops):
            s = loop_iteration(w, cfg, s, p, ctx, t)
            if w.exit_gate_weight is not None:
                gate_logit(w, s)
            clock.mark(f"loop {t + 1}")
        x = exit_hidden(w, cfg, s, ctx)
        clock.mark("coda")
        logits = head(w, cfg, x)
        clock.mark("head")
    return logits, clock.segments


def work_kind(name: str) -> str:
    """'attention', 'matrix' or 'other' for a profiler op or kernel name."""
    low = name.lower()
    if any(n in low for n in ATTENTION_NAMES):
        return "attention"
    if any(n in low for n in MATRIX_NAMES):
        return "matrix"
    return "other"


def work_split(engine: Engine, tokens: torch.Tensor, loops: int) -> dict[str, float]:
    """Milliseconds of attention, matrix and other work in one scoring forward, from torch.profiler.

    Each top-level op (one the model code called) counts whole, by its name: its CPU time on CPU, the time
    of the device kernels it launched on CUDA. A kernel launched outside any op (a runtime call such as
    cuLaunchKernel at top level, e.g. Triton) counts by the kernel's own name.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(engine.device)
    with profile(activities=activities) as prof:
        engine.step(tokens, None, loops)
        synchronize(engine.device)
    split = {"attention": 0.0, "matrix": 0.0, "other": 0.0}
    for event in prof.events():
        if event.device_type != DeviceType.CPU or event.cpu_parent is not None or event.is_async:
            continue
        if not cuda:
            split[work_kind(event.name)] += event.cpu_time_total / 1e3
        elif event.name.startswith("cu"):
            for kernel in event.kernels:
                split[work_kind(kernel.name)] += kernel.duration / 1e3
        else:
            split[work_kind(event.name)] += event.device_time_total / 1e3
    return split


# generate_rows(prompts [B, T], max_tokens) -> (row, token) as generated: the API's batched greedy stream.
RowGenerator = Callable[[torch.Tensor, int], Iterator[tuple[int, int]]]


def time_decode(generate_rows: RowGenerator, tokens: torch.Tensor, steps: int) -> tuple[float, float]:
    """(prefill seconds, seconds of `steps` decode steps) of greedy generation after prompt rows `tokens`
    [B, T], through the same generation path users call: the prefill ends with every row's first token."""
    rows = tokens.shape[0]
    seen = 0
    t0 = time.perf_counter()
    t1 = t0
    for _ in generate_rows(tokens, steps + 1):
        seen += 1
        if seen == rows:
            t1 = time.perf_counter()
    if seen != rows * (steps + 1):
        raise RuntimeError(f"the decode benchmark generated {seen} tokens, not {rows * (steps + 1)}")
    return t1 - t0, time.perf_counter() - t1


def run_benchmark(
    engine: Engine, header: ModelHeader, bench: BenchmarkConfig, generate_rows: RowGenerator | None = None
) -> BenchmarkResult:
    """Measure `engine` as `bench` says (bench.check(cfg) first: ValueError for out-of-range values).
    bench.decode needs `generate_rows`, the API's batched greedy generation (Model.generate_batch_stream)."""
    cfg = engine.cfg
    bench.check(cfg)
    check_host_memory(engine.device, forward_bytes(cfg, bench.batch, bench.seq_len, engine.dtype))
    tokens = synthetic_tokens(cfg.vocab_size, bench.batch, bench.seq_len, bench.seed).to(engine.device)
    warmup = not bench.profile
    if warmup:
        time_forward(engine, tokens, bench.loops)
    segment_runs: list[dict[str, float]] = []
    times = []
    for _ in range(bench.repeat):
        if bench.profile:
            synchronize(engine.device)
            t0 = time.perf_counter()
            _, seg = segmented_forward(engine, tokens, bench.loops)
            times.append(time.perf_counter() - t0)
            segment_runs.append(seg)
        else:
            times.append(time_forward(engine, tokens, bench.loops))
    result = BenchmarkResult(
        device=str(engine.device),
        device_name=device_name(engine.device),
        torch_version=torch.__version__,
        threads=torch.get_num_threads(),
        model=model_summary(header, engine),
        quantization=quantization_summary(header),
        config=bench,
        warmup=warmup,
        forward=Latency.of(times),
    )
    set_switches = {k: v for k, v in asdict(RuntimeEnv.read()).items() if v}
    ignored = unapplied_switches(bench)
    result.switches = {k: v for k, v in set_switches.items() if k not in ignored}
    result.not_applied = [f"TINYLOOP_{k.upper()}" for k in set_switches if k in ignored]
    if bench.profile:
        result.segments = {name: Latency.of([run[name] for run in segment_runs]) for name in segment_runs[0]}
        result.work = work_split(engine, tokens, bench.loops)
    if bench.decode:
        if generate_rows is None:
            raise ValueError("the decode benchmark needs the model's generation (generate_rows)")
        if warmup:
            time_decode(generate_rows, tokens, min(bench.decode, 4))
        runs = [time_decode(generate_rows, tokens, bench.decode) for _ in range(bench.decode_repeat)]
        result.decode = DecodeResult(
            tokens=bench.decode,
            prefill=Latency.of([r[0] for r in runs]),
            decode=Latency.of([r[1] for r in runs]),
            batch=bench.batch,
        )
    return result


# ---- descriptions -------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def model_summary(header: ModelHeader, engine: Engine) -> dict[str, Any]:
    cfg = header.config
    return {
        "name": cfg.name or Path(header.path).stem,
        "file": Path(header.path).name,
        "family": cfg.family,
        "parameters": parameter_count(cfg),
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "ffn_dim": cfg.ffn_dim,
        "layers": {"prelude": cfg.n_prelude, "body": cfg.n_body, "coda": cfg.n_coda},
        "default_loops": cfg.default_loops,
        "max_position": cfg.max_position,
        "compute_dtype": str(engine.dtype).removeprefix("torch."),
        "matmul_dtype": matmul_dtype(engine),
        "weight_bytes_on_device": weight_bytes(engine.weights),
    }


def matmul_dtype(engine: Engine) -> str:
    """bfloat16 where torch's CPU INT4 kernel multiplies the body (kernels/cpu_int4.py), else the compute dtype."""
    if any(isinstance(m, CpuInt4Weight) for lw in engine.weights.body for m in lw.matrices()):
        return "bfloat16"
    return str(engine.dtype).removeprefix("torch.")


def quantization_summary(header: ModelHeader) -> dict[str, Any]:
    q = header.quantization
    return {"bits": q.bits, "group_size": q.group_size, "float_dtype": q.float_dtype}


def write_preset_model(name: str, directory: str | os.PathLike[str], bits: int = 4, seed: int = 0) -> Path:
    """A random-weight `.tinyloop` file of a preset (e.g. seed-407m at INT4) in `directory`, written once
    and reused on later calls."""
    from tinyloop.convert.random_model import write_random_model
    from tinyloop.presets import preset

    cfg = preset(name)
    path = Path(directory) / f"{name}-{bits}bit-seed{seed}.tinyloop"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_model(path, cfg, seed, bits, 64 if bits == 4 else None, progress=False)
    return path
