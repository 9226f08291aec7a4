"""The CUDA decode step's launch sequence, recorded on the CPU: for a refactor of the fused path that must not
change what a captured graph replays.

    PYTHONPATH=src python bench/trace_fused_launches.py --out after.json          # this checkout
    PYTHONPATH=/other/src python bench/trace_fused_launches.py --out before.json  # another checkout
    python bench/trace_fused_launches.py --compare before.json after.json

The FusedDecoder runs eagerly in Triton's interpreter (TRITON_INTERPRET=1) on small INT4 models of four
architecture variants (plain and blocked INT4 layouts): a prefill, one-token decode, a two-token step at fewer
loops, a resumed verification step and an uncached scoring step. Recorded in order: every Triton launch (kernel,
grid, argument shapes, compile-time options) and every torch call outside the kernels (views and indexing left
out), plus the logits and gate sums (equal results, bit for bit, when the launches are).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined

import torch
from torch.overrides import TorchFunctionMode

BASE = dict(vocab_size=80, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, n_prelude=1, n_body=2,
            n_coda=1, max_position=64)  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "pre-concat-zeros-gqa": dict(injection="concat", state_start="zeros", head_norm=True),
    "interleaved-qkbias-add": dict(rope_pairing="interleaved", qk_bias=True, injection="add", n_kv_heads=4),
    "huginn-like": dict(
        norm_placement="sandwich_sum",
        injection="concat",
        state_start="random",
        state_init_std=0.6,
        loop_norm="after_loop",
        head_norm=True,
        embed_scale=5.0,
        qk_bias=True,
        ffn_kind="gelu",
        logit_scale=0.5,
    ),  # fmt: skip
    "ouro-like": dict(
        norm_placement="sandwich_out",
        n_prelude=0,
        n_coda=0,
        loop_norm="every_loop",
        head_norm=False,
        tied_embeddings=False,
        exit_gate=True,
        injection="none",
        n_kv_heads=4,
    ),  # fmt: skip
}
QUIET = {"__getitem__", "__setitem__", "view", "reshape", "contiguous", "t", "transpose", "squeeze", "unsqueeze",
         "expand", "chunk", "split", "select", "narrow", "flatten", "__eq__", "__ne__", "any", "all", "__and__",
         "__or__", "__invert__", "__get__", "data_ptr", "stride", "dim", "size", "numel", "element_size",
         "is_contiguous", "__len__", "__index__", "__bool__", "__int__", "__format__", "item", "tolist"}  # fmt: skip


def record() -> dict[str, Any]:
    import triton.runtime.interpreter as interp

    from tinyloop.config import ArchConfig
    from tinyloop.layout import model_specs
    from tinyloop.model.weights import ModelWeights
    from tinyloop.quant import BlockedInt4Weight, Int4Weight, quantize_int4
    from tinyloop.runtime.engine import Engine
    from tinyloop.runtime.fused_decode import FusedDecoder

    log: list[list[str]] = []
    depth = [0]

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", str(func))
            if not depth[0] and name not in QUIET:
                log.append(["torch", name, str([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])])
            return func(*args, **(kwargs or {}))

    run = interp.InterpretedFunction.run

    def launch(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        g = grid(kwargs) if callable(grid) else grid
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a if isinstance(a, int | float | bool)
                  else type(a).__name__ for a in args]  # fmt: skip
        log.append(["kernel", self.fn.__name__, str(tuple(g)), str(shapes), str(sorted(kwargs.items()))])
        depth[0] += 1
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            depth[0] -= 1

    interp.InterpretedFunction.run = launch  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for variant in [*VARIANTS, "blocked:pre-concat-zeros-gqa", "blocked:ouro-like"]:
        blocked = variant.startswith("blocked:")
        cfg = ArchConfig(
            **{**BASE, **VARIANTS[variant.removeprefix("blocked:")], **(dict(ffn_dim=128) if blocked else {})}
        )
        gen = torch.Generator().manual_seed(1)
        flat: dict[str, Any] = {}
        for spec in model_specs(cfg):
            t = torch.randn(spec.shape, generator=gen)
            flat[spec.name] = (
                1 + 0.1 * t if spec.role == "vector" and "norm" in spec.name else 0.3 * t / spec.shape[-1] ** 0.5
            )
            if spec.role != "vector" and spec.name.startswith(("prelude.", "body.", "coda.", "adapter.", "head.")):
                q = quantize_int4(flat[spec.name], 64 if blocked else 32)
                flat[spec.name] = BlockedInt4Weight.from_int4(q) if blocked and type(q) is Int4Weight else q
        engine = Engine(cfg, ModelWeights.from_flat(cfg, flat), torch.device("cpu"), torch.float32)
        engine.decoder = FusedDecoder(engine, graphs=False)
        log.clear()
        results = []
        tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
        with Calls():
            cache = engine.new_cache(2, 24, 3)
            results.append(engine.step(tokens, cache, 3))
            results.append(engine.step(tokens[:, :1], cache, 3, last_only=True))
            results.append(engine.step(tokens[:, :2], cache, 2))
            draft = engine.step(tokens[:, :1], cache, 1, last_only=True)
            results.append(draft)
            results.append(engine.step(tokens[:, :1], cache, 3, start=torch.tensor([8, 8]), resume=draft.resume_at(1)))
            results.append(engine.step(tokens[:1], None, 2))
        sums = [float(torch.as_tensor(r.logits).double().sum()) for r in results]
        gates = [[g.double().sum().item() for g in r.gates] for r in results]
        out[variant] = {"log": [list(x) for x in log], "logits": sums, "gates": gates}
    return out


def compare(before: dict[str, Any], after: dict[str, Any]) -> bool:
    same = True
    for variant in before:
        a, b = before[variant], after[variant]
        kernels = [x for x in a["log"] if x[0] == "kernel"], [x for x in b["log"] if x[0] == "kernel"]
        calls = [x for x in a["log"] if x[0] == "torch"], [x for x in b["log"] if x[0] == "torch"]
        ok = (
            kernels[0] == kernels[1]
            and calls[0] == calls[1]
            and a["logits"] == b["logits"]
            and a["gates"] == b["gates"]
        )
        same &= ok
        results = "equal" if a["logits"] == b["logits"] else "DIFFER"
        print(f"{variant}: {len(kernels[0])} / {len(kernels[1])} launches, {len(calls[0])} / {len(calls[1])} torch "
              f"calls, results {results}: {'same' if ok else 'DIFFERENT'}")  # fmt: skip
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write this checkout's trace here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        return 0 if compare(before, after) else 1
    if args.out is None:
        parser.error("give --out FILE or --compare BEFORE AFTER")
    args.out.write_text(json.dumps(record()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
