"""CPU decode speed of the built-in model: plain INT4 against cross-iteration rounding (cached and redrawn).

PYTHONPATH=src python bench/cross_iter_cpu.py --channels runs/cross_iter/tiny_sign.tinyloop
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from tinyloop import Model

ROOT = Path(__file__).resolve().parent.parent
PROMPT = np.frombuffer(b"def fibonacci(n):\n", dtype=np.uint8).astype(np.int32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", type=Path, required=True, help="the built-in model with rounding channels")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--loops", type=int, default=8)
    args = p.parse_args(argv)
    runs = [
        ("plain INT4 (flag off)", "tiny", {}),
        ("cross-iter, CPU cache (default)", args.channels, {"cross_iter_round": True}),
    ]
    for label, path, kw in runs:
        with Model(path, device="cpu", **kw) as m:  # type: ignore[arg-type]
            m.generate(PROMPT, max_tokens=2, loops=args.loops, temperature=0.0)  # warm-up (fills the cache)
            t0 = time.perf_counter()
            m.generate(PROMPT, max_tokens=args.tokens, loops=args.loops, temperature=0.0)
            dt = time.perf_counter() - t0
        print(f"{label}: {args.tokens / dt:.1f} tokens/s ({args.tokens} tokens, loops {args.loops})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
