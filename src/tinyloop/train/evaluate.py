"""Held-out bits per byte at several loop counts, on a fixed set of validation windows, plus the plot."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tinyloop.config import ArchConfig
from tinyloop.convert.weight_shards import load_weight_shards
from tinyloop.format.reader import load_weights, read_header
from tinyloop.kernels.dispatch import Weight
from tinyloop.model.looped import embed, exit_hidden, head, initial_state, loop_iteration, run_prelude
from tinyloop.model.weights import ModelWeights
from tinyloop.quant import Int4Weight, Int8Weight
from tinyloop.runtime.engine import Engine
from tinyloop.train.codegen import TEMPERATURE, TOP_K, find_headers, generate, parse_rate
from tinyloop.train.corpus import split_documents

EVAL_LOOPS = (1, 2, 4, 8, 12, 16)
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def eval_windows(data: bytes | np.ndarray, n_windows: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len + 1] uint8 windows at evenly spaced offsets, first at 0 and last at the very end.

    Windows never overlap when the data holds n * (seq_len + 1) bytes; with less data the count is
    reduced to what fits (so the same arguments always give the same windows for the same data).
    """
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else np.asarray(data, np.uint8)
    span = seq_len + 1
    n = min(n_windows, len(arr) // span)
    if n < 1:
        raise ValueError(f"validation data of {len(arr)} bytes is shorter than one window of {span}")
    last = len(arr) - span
    offsets = [0] if n == 1 else [round(i * last / (n - 1)) for i in range(n)]
    return torch.from_numpy(np.stack([arr[o : o + span] for o in offsets]).copy())


def _nats(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.float().flatten(0, 1), target.to(logits.device).flatten(), reduction="sum"))


def bits_per_byte(logits_fn: LogitsFn, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-byte cross-entropy in bits over every predicted position: window[:, 1:] given window[:, :-1]."""
    nats = 0.0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch].long()
        nats += _nats(logits_fn(chunk[:, :-1]), chunk[:, 1:])
    return nats / (windows.shape[0] * (windows.shape[1] - 1)) / math.log(2)


def dense_weights(flat: Mapping[str, Weight], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Float32 tensors on the device; INT8/INT4 matrices dequantized once."""
    out: dict[str, torch.Tensor] = {}
    for name, w in flat.items():
        if isinstance(w, (Int4Weight, Int8Weight)):
            out[name] = w.to(device).dequantize(torch.float32)
        else:
            out[name] = w.detach().to(device=device, dtype=torch.float32)
    return out


def engine_from_flat(cfg: ArchConfig, flat: Mapping[str, Weight], device: torch.device | str) -> Engine:
    dev = torch.device(device)
    return Engine(cfg, ModelWeights.from_flat(cfg, dense_weights(flat, dev)), dev, torch.float32)


def engine_from_file(path: str | os.PathLike[str], device: torch.device | str = "cpu") -> Engine:
    header, flat = load_weights(path, device="cpu")
    return engine_from_flat(header.config, flat, device)


def bpb_by_loops(
    engine: Engine, windows: torch.Tensor, loops: Sequence[int] = EVAL_LOOPS, batch: int = 8
) -> dict[int, float]:
    """Bits per byte of the full-sequence forward (no cache) at each loop count, as bits_per_byte would
    give with engine.step; one pass shares the prelude and the loop iterations between the counts."""
    nats = dict.fromkeys(loops, 0.0)
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch].long()
        for n, logits in sweep_logits(engine, chunk[:, :-1], loops):
            nats[n] += _nats(logits, chunk[:, 1:])
    count = windows.shape[0] * (windows.shape[1] - 1)
    return {n: nats[n] / count / math.log(2) for n in loops}


def sweep_logits(engine: Engine, tokens: torch.Tensor, loops: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
    """(n, logits at n loops) for each n in `loops`, ascending: the state after iteration n is the same
    whatever the total count, so each count only adds its own coda and head."""
    cfg, w = engine.cfg, engine.weights
    with torch.inference_mode():
        tokens = tokens.to(engine.device)
        B, T = tokens.shape
        positions = torch.arange(T, device=engine.device)[None, :].expand(B, T)
        ctx = engine.context(positions, None, None)
        p = run_prelude(w, cfg, embed(w, cfg, tokens, engine.dtype), ctx)
        s = initial_state(cfg, p, positions, engine.noise)
        wanted = sorted(set(loops))
        for t in range(wanted[-1]):
            s = loop_iteration(w, cfg, s, p, ctx, t)
            if t + 1 in wanted:
                yield t + 1, head(w, cfg, exit_hidden(w, cfg, s, ctx))


def plot_bpb(curves: Mapping[str, Mapping[int, float]], path: Path, title: str) -> None:
    """Bits per byte vs loop count, one line per model variant (matplotlib is a dev-only dependency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        xs = sorted(curve)
        ax.plot(xs, [curve[x] for x in xs], marker="o", label=label)
    ax.set_xlabel("loops")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SAMPLE_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n")


def read_val_docs(corpus: Path) -> tuple[bytes, list[tuple[str, bytes]], dict[str, Any]]:
    """val.bin, its documents paired with their relative paths, and the manifest; the split's hash is checked."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    val = (corpus / "val.bin").read_bytes()
    want = manifest["splits"]["val"]["sha256"]
    if hashlib.sha256(val).hexdigest() != want:
        raise ValueError(f"{corpus / 'val.bin'} does not match the sha256 in its manifest ({want})")
    docs = split_documents(val)
    return val, list(zip(manifest["val_files"], docs, strict=True)), manifest


def evaluate_model_file(
    model: Path,
    corpus: Path,
    out_dir: Path,
    *,
    float_weights: Path | None = None,
    windows: int = 16,
    seq_len: int = 1024,
    loops: Sequence[int] = EVAL_LOOPS,
    headers: int = 20,
    parse_loops: int | None = None,
    sample_loops: Sequence[int] = (2, 8),
    sample_bytes: int = 200,
    parse_bytes: int = 256,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """The built-in model's report on CPU: bits per byte by loops, parse rate, samples; JSON + PNG."""
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    val, docs, manifest = read_val_docs(corpus)
    wins = eval_windows(val, windows, seq_len)
    header = read_header(model)
    cfg = header.config
    engine = engine_from_file(model, device)
    label = f"INT{header.quantization.bits}" if header.quantization.bits < 16 else "file"
    curves = {label: bpb_by_loops(engine, wins, loops)}
    if float_weights is not None:
        _, flat = load_weight_shards(float_weights)
        curves["float (fp16 weights)"] = bpb_by_loops(engine_from_flat(cfg, flat, device), wins, loops)
    n_parse = parse_loops or cfg.default_loops
    rate, results = parse_rate(engine, find_headers(docs, headers), n_parse, parse_bytes, seed)
    samples = []
    for n in sample_loops:
        texts = generate(
            engine,
            [p.encode() for p in SAMPLE_PROMPTS],
            n,
            sample_bytes,
            [seed + i for i in range(len(SAMPLE_PROMPTS))],
        )
        samples += [
            {"loops": n, "prompt": p, "text": t.decode("utf-8", "replace")}
            for p, t in zip(SAMPLE_PROMPTS, texts, strict=True)
        ]
    report: dict[str, Any] = {
        "model": str(model),
        "model_bytes": model.stat().st_size,
        "config": cfg.name,
        "corpus": {"python_version": manifest["python_version"], "val_sha256": manifest["splits"]["val"]["sha256"]},
        "bpb": {"windows": int(wins.shape[0]), "seq_len": seq_len, "curves": curves},
        "parse_rate": {
            "loops": n_parse,
            "rate": rate,
            "headers": len(results),
            "max_new_bytes": parse_bytes,
            "results": results,
        },
        "sampling": {"temperature": TEMPERATURE, "top_k": TOP_K, "seed": seed},
        "samples": samples,
    }
    plot_bpb(
        curves, out_dir / "bpb_vs_loops.png", f"{cfg.name}: held-out bits per byte ({int(wins.shape[0])} x {seq_len} B)"
    )
    report["time_s"] = time.monotonic() - t0
    (out_dir / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
