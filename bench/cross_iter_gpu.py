"""GPU decode speed with cross-iteration rounding against plain INT4, on a random-weight preset (seed-407m).

Builds the INT4 g64 file, its float checkpoint and the two channel files in --work, then times greedy
decode for each (after a warm-up) and prints one JSON object. Run on a CUDA machine:

    PYTHONPATH=src python bench/cross_iter_gpu.py --preset seed-407m --tokens 128 --loops 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from tinyloop import Model
from tinyloop.convert.add_channels import add_rounding_channels
from tinyloop.convert.random_model import random_weights
from tinyloop.format.writer import write_model
from tinyloop.model.cross_iter import has_cross_iter
from tinyloop.presets import preset


def build(name: str, work: Path) -> dict[str, Path]:
    work.mkdir(parents=True, exist_ok=True)
    files = {"int4": work / f"{name}-int4.tinyloop", "sign": work / f"{name}-sign.tinyloop"}
    files["frac4"] = work / f"{name}-frac4.tinyloop"
    if all(p.exists() for p in files.values()):
        return files
    cfg = preset(name)
    floats = random_weights(cfg, seed=0)
    write_model(files["int4"], cfg, floats, bits=4, group_size=64)
    ckpt = work / f"{name}-float.pt"
    torch.save({k: v.half() for k, v in floats.items()}, ckpt)
    del floats
    add_rounding_channels(files["int4"], files["sign"], ckpt, 1)
    add_rounding_channels(files["int4"], files["frac4"], ckpt, 4)
    return files


def time_decode(path: Path, cross_iter: bool, tokens: int, loops: int, repeat: int) -> dict[str, object]:
    prompt = np.arange(16, dtype=np.int32)
    with Model(path, device="cuda", cross_iter_round=cross_iter) as m:
        stochastic = has_cross_iter(m._engine.weights)
        if cross_iter and m._engine.decoder is not None:
            # A specialised decoder would run the looped matrices as plain INT4 and time the wrong thing.
            raise SystemExit(
                "a specialised decoder is active with cross-iteration rounding: select_decoder must skip it"
            )
        m.generate(prompt, max_tokens=8, loops=loops, temperature=0.0)
        best = float("inf")
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m.generate(prompt, max_tokens=tokens, loops=loops, temperature=0.0)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return {"tokens_per_s": tokens / best, "ms_per_token": 1000 * best / tokens, "stochastic": stochastic}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="seed-407m")
    p.add_argument("--work", type=Path, default=Path("runs/cross_iter_gpu"))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--loops", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    files = build(args.preset, args.work)
    report: dict[str, object] = {"preset": args.preset, "tokens": args.tokens, "loops": args.loops}
    for label, path, on in (
        ("int4", files["int4"], False),
        ("sign", files["sign"], True),
        ("frac4", files["frac4"], True),
    ):
        report[label] = time_decode(path, on, args.tokens, args.loops, args.repeat)
        print(label, report[label], flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
