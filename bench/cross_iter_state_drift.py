"""How far the loop state drifts from the float model's, iteration by iteration, under each rounding.

One held-out window of the built-in model; prints the relative distance ||s_t - s_t(float)|| / ||s_t(float)||
at each iteration for plain INT4 and the two channels (seed 0) and writes OUT/state_drift.json:

    PYTHONPATH=src python bench/cross_iter_state_drift.py [--out runs/cross_iter] [--loops 32]

Run bench/eval_cross_iter.py first: it writes the channel files this reads from OUT.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tinyloop.convert.add_channels import load_float_checkpoint
from tinyloop.format.header import read_header
from tinyloop.model.looped import embed, initial_state, loop_iteration, run_prelude
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.loader import load_engine
from tinyloop.stochastic.weight import CrossIterRound
from tinyloop.train.evaluate import engine_from_flat, eval_windows, read_val_docs

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "src" / "tinyloop" / "builtin" / "tiny.tinyloop"
FLOAT = ROOT / ".carry" / "tiny_run1" / "weights_fp16.index.json"
CPU = torch.device("cpu")


def states(engine: Engine, tokens: torch.Tensor, loops: int) -> list[torch.Tensor]:
    cfg, w = engine.cfg, engine.weights
    with torch.inference_mode():
        positions = torch.arange(tokens.shape[1])[None, :]
        ctx = engine.context(positions, None, None)
        p = run_prelude(w, cfg, embed(w, cfg, tokens, engine.dtype), ctx)
        s = initial_state(cfg, p, positions, engine.noise)
        out = []
        for t in range(loops):
            s = loop_iteration(w, cfg, s, p, ctx, t)
            out.append(s.double())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "cross_iter")
    ap.add_argument("--loops", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)
    val, _, _ = read_val_docs(ROOT / ".carry" / "corpus")
    tokens = eval_windows(val, 1, args.seq_len)[:, :-1].long()
    ref = states(engine_from_flat(read_header(MODEL).config, load_float_checkpoint(FLOAT), CPU), tokens, args.loops)
    engines = {
        "INT4": load_engine(MODEL, CPU, torch.float32)[1],
        "sign": load_engine(args.out / "tiny_sign.tinyloop", CPU, torch.float32, CrossIterRound(0))[1],
        "frac4": load_engine(args.out / "tiny_frac4.tinyloop", CPU, torch.float32, CrossIterRound(0))[1],
    }
    drift = {}
    for label, eng in engines.items():
        got = states(eng, tokens, args.loops)
        drift[label] = [float((g - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True)]
        print(label, " ".join(f"{t + 1}:{d:.3f}" for t, d in enumerate(drift[label])), flush=True)
    (args.out / "state_drift.json").write_text(json.dumps(drift, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
