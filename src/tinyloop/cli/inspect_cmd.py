"""`tinyloop FILE inspect`: describe a model file from its header alone (never imports torch)."""

from __future__ import annotations

import json
import sys
from typing import Any

from tinyloop.cli.args import Parser, parse_or_exit_code
from tinyloop.config import ArchConfig
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.header import ModelHeader, read_header
from tinyloop.layout import model_specs, parameter_count

SEQ_LENS = (512, 2048, 8192)
SLIDING_WINDOW = 512
# "dense": the full cache (kv_mode '16bit'), stored like "window" and "hidden" in the run's compute dtype.
KV_MODES = ("dense", "int8", f"window-{SLIDING_WINDOW}", "hidden", "none")
# runtime.loader.FLOAT32_MAX_WIDTH, repeated so that inspect imports no torch: CUDA computes (and caches)
# in float32 up to this width, else bfloat16; the CPU always in float32.
FLOAT32_MAX_WIDTH = 1024
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def run_inspect(path: str, argv: list[str]) -> int:
    parser = Parser(prog="tinyloop inspect", description="Describe a .tinyloop file (reads the header only).")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-seq-len", type=int, metavar="N", help="also estimate buffers at sequence length N")
    args = parse_or_exit_code(parser, argv)
    if isinstance(args, int):
        return args
    if args.max_seq_len is not None and args.max_seq_len < 1:
        print(f"tinyloop: error: --max-seq-len must be at least 1, got {args.max_seq_len}", file=sys.stderr)
        return 2
    try:
        header = read_header(path)
    except TinyLoopFormatError as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return 1
    seq_lens = sorted(set(SEQ_LENS) | ({args.max_seq_len} if args.max_seq_len else set()))
    report = describe(header, seq_lens)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


# ---- estimates --------------------------------------------------------------------------------


def activation_bytes(cfg: ArchConfig, seq_len: int) -> int:
    """Workspace for one prefill pass of `seq_len` tokens at batch 1, 2 bytes per element.

    Counts per token: six d_model-wide buffers (loop state, residual, normed input, attention
    output, injection input, scratch), the fused QKV projection, and the FFN hidden buffers (three
    for SwiGLU: gate, up, product; two for GELU); plus one row of FP32 logits. Attention scores
    are counted separately (attention_score_bytes).
    """
    ffn_buffers = 3 if cfg.ffn_kind == "swiglu" else 2
    per_token = 6 * cfg.d_model + cfg.q_dim + 2 * cfg.kv_dim + ffn_buffers * cfg.ffn_dim
    return seq_len * per_token * 2 + cfg.vocab_size * 4


def attention_score_bytes(cfg: ArchConfig, seq_len: int) -> int:
    """FP32 scores of one layer when materialised (an upper bound; fused attention needs far less)."""
    return cfg.n_heads * seq_len * seq_len * 4


def kv_dtypes(cfg: ArchConfig) -> dict[str, str]:
    """The dtype a run stores its KV cache in, by device, when --dtype is left at auto."""
    return {"cpu": "float32", "cuda": "float32" if cfg.d_model <= FLOAT32_MAX_WIDTH else "bfloat16"}


def kv_bytes(cfg: ArchConfig, mode: str, seq_len: int, loops: int, element_bytes: int = 2) -> int:
    """KV-cache bytes at batch 1 for one cache mode, dense values of `element_bytes` each."""
    slots = cfg.n_cache_slots(loops)
    if mode == "dense":
        return slots * seq_len * 2 * cfg.kv_dim * element_bytes
    if mode == "int8":
        # INT8 K and V plus one FP16 scale per head per token for each.
        return slots * seq_len * 2 * (cfg.kv_dim + 2 * cfg.n_kv_heads)
    if mode.startswith("window-"):
        return slots * min(seq_len, int(mode.split("-", 1)[1])) * 2 * cfg.kv_dim * element_bytes
    if mode == "hidden":
        # Stores the normalised attention input (d_model wide) and recomputes K and V.
        return slots * seq_len * cfg.d_model * element_bytes
    if mode == "none":
        return 0
    raise ValueError(f"unknown KV mode {mode!r}")


def describe(header: ModelHeader, seq_lens: list[int]) -> dict[str, Any]:
    cfg = header.config
    quant = header.quantization
    specs = model_specs(cfg)
    kinds = {"dense": 0, "int8": 0, "int4": 0, "vector": 0}
    for spec in specs:
        kinds["vector" if spec.role == "vector" else quant.tensors[spec.name].kind] += 1
    params = parameter_count(cfg)
    loops = cfg.default_loops
    dtypes = kv_dtypes(cfg)
    return {
        "file": header.path,
        "file_bytes": header.file_size,
        "format": "tinyloop",
        "format_version": header.format_version_str,
        "quantization": {
            "bits": quant.bits,
            "group_size": quant.group_size,
            "float_dtype": quant.float_dtype,
            "tensor_kinds": kinds,
        },
        "model": {
            "name": cfg.name,
            "family": cfg.family,
            "vocab_size": cfg.vocab_size,
            "tokenizer": cfg.tokenizer,
            "d_model": cfg.d_model,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "ffn_dim": cfg.ffn_dim,
            "ffn_kind": cfg.ffn_kind,
            "norm_kind": cfg.norm_kind,
            "norm_placement": cfg.norm_placement,
            "n_prelude": cfg.n_prelude,
            "n_body": cfg.n_body,
            "n_coda": cfg.n_coda,
            "default_loops": loops,
            "effective_depth": cfg.n_prelude + loops * cfg.n_body + cfg.n_coda,
            "max_position": cfg.max_position,
        },
        "embedding": {
            "tied": cfg.tied_embeddings,
            "embed_scale": cfg.embed_scale,
            "logit_scale": cfg.logit_scale,
            "injection": cfg.injection,
            "state_start": cfg.state_start,
        },
        "parameters": params,
        "weight_bytes": header.weight_bytes,
        "fp16_baseline_bytes": params * 2,
        "compression_vs_fp16": round(params * 2 / header.weight_bytes, 3) if header.weight_bytes else None,
        "buffers": {
            "batch": 1,
            "loops": loops,
            "kv_slots": cfg.n_cache_slots(loops),
            "kv_dtype": dtypes,
            "per_seq_len": [
                {
                    "seq_len": t,
                    "activation_bytes": activation_bytes(cfg, t),
                    "attention_score_bytes": attention_score_bytes(cfg, t),
                    "kv_bytes": {
                        device: {mode: kv_bytes(cfg, mode, t, loops, DTYPE_BYTES[dtype]) for mode in KV_MODES}
                        for device, dtype in dtypes.items()
                    },
                }
                for t in seq_lens
            ],
        },
    }


# ---- text rendering ---------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def render(r: dict[str, Any]) -> str:
    q, m, e, b = r["quantization"], r["model"], r["embedding"], r["buffers"]
    kinds = q["tensor_kinds"]
    precision = {16: q["float_dtype"], 8: "INT8 (per-row)", 4: f"INT4 (group size {q['group_size']})"}[q["bits"]]
    ratio = r["compression_vs_fp16"]
    lines = [
        f"file          {r['file']} ({human_bytes(r['file_bytes'])})",
        f"format        tinyloop {r['format_version']}",
        f"weights       {q['bits']}-bit: {precision}; tensors: {kinds['int4']} int4, {kinds['int8']} int8, "
        f"{kinds['dense']} dense {q['float_dtype']}, {kinds['vector']} F32 vectors",
        f"model         {m['name'] or '(unnamed)'} (family {m['family']})",
        f"dimensions    d_model {m['d_model']}, heads {m['n_heads']}, kv heads {m['n_kv_heads']}, "
        f"head_dim {m['head_dim']}, ffn {m['ffn_dim']} ({m['ffn_kind']})",
        f"layers        prelude {m['n_prelude']}, body {m['n_body']}, coda {m['n_coda']}; "
        f"default loops {m['default_loops']} (effective depth {m['effective_depth']})",
        f"vocab         {m['vocab_size']} ({m['tokenizer']} tokenizer), max position {m['max_position']}",
        f"embedding     {'tied' if e['tied'] else 'untied'}, embed scale {e['embed_scale']}, "
        f"injection {e['injection']}, state start {e['state_start']}",
        f"parameters    {r['parameters']:,}",
        f"weight bytes  {human_bytes(r['weight_bytes'])} "
        f"(FP16 baseline {human_bytes(r['fp16_baseline_bytes'])}, {ratio}x smaller)",
        f"buffers       batch 1, {b['loops']} loops, {b['kv_slots']} KV slots "
        "(activations: one prefill pass; scores: one layer, FP32, if materialised)",
    ]
    cpu, cuda = b["kv_dtype"]["cpu"], b["kv_dtype"]["cuda"]
    both = cpu == cuda
    where = f"CPU and CUDA: {cpu}" if both else f"CUDA: {cuda}; the CPU stores {cpu}, in the last column"
    lines.append(f"KV cache      dense, window and hidden modes in the run's dtype ({where}; --dtype changes it)")
    header = ["seq len", "activations", "attn scores"] + [f"kv {mode}" for mode in KV_MODES]
    header += [] if both else ["kv dense CPU"]
    rows = [header]
    for row in b["per_seq_len"]:
        cells = [str(row["seq_len"]), human_bytes(row["activation_bytes"]), human_bytes(row["attention_score_bytes"])]
        cells += [human_bytes(row["kv_bytes"]["cuda"][mode]) for mode in KV_MODES]
        cells += [] if both else [human_bytes(row["kv_bytes"]["cpu"]["dense"])]
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for cells in rows:
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)
