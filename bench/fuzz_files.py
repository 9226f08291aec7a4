"""The larger run of the file fuzz suite (tests/file_fuzz.py): model files, prefix pool files, HF folders.

    python bench/fuzz_files.py --cases 2000 [--seed 1] [--kinds model pool hf]

Prints cases tried / refused / loaded unchanged (and, for HF folders, converted into another valid model)
per kind, and exits 1 at the first case with any other outcome (its description and the exception).
Results are in docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests" / "families")]

from family_helpers import copy_vectors  # noqa: E402

import file_fuzz  # noqa: E402
from tinyloop.convert.random_model import random_weights  # noqa: E402
from tinyloop.format.writer import write_model  # noqa: E402
from tinyloop.presets import preset  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000, help="cases per kind (HF: split between Ouro and Huginn)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", nargs="+", default=["model", "pool", "hf"], choices=["model", "pool", "hf"])
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    results: dict[str, tuple[Counter[str], float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cfg = preset("test-tiny")
        source = work / "test-tiny-int4.tinyloop"
        write_model(source, cfg, random_weights(cfg, seed=1), bits=4, group_size=64, progress=False)
        try:
            for kind in args.kinds:
                start = time.perf_counter()
                with contextlib.redirect_stderr(io.StringIO()):
                    results[kind] = (run_kind(kind, source, work, args.cases, args.seed), 0.0)
                results[kind] = (results[kind][0], time.perf_counter() - start)
                report(kind, *results[kind])
        except file_fuzz.FuzzFailure as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
    total = sum(sum(c.values()) for c, _ in results.values())
    print(f"all kinds: {total} cases, zero other outcomes (seed {args.seed})")
    return 0


def run_kind(kind: str, source: Path, work: Path, cases: int, seed: int) -> Counter[str]:
    folder = work / kind
    folder.mkdir()
    if kind == "model":
        return file_fuzz.fuzz_model_files(source, folder, cases, seed)
    if kind == "pool":
        import tinyloop

        out: Counter[str] = Counter()
        for i, mode in enumerate(("16bit", "int8", "hidden", "window")):
            window = 6 if mode == "window" else None
            with tinyloop.Model(source, max_seq_len=64, device="cpu", kv_mode=mode, cache_window=window) as m:
                sub = folder / mode
                sub.mkdir()
                out += file_fuzz.fuzz_pool_files(m, sub, cases // 4, seed + i)
        return out
    out = Counter()
    for i, family in enumerate(("ouro", "huginn")):
        sub = folder / family
        sub.mkdir()
        hf = copy_vectors(family, sub / "source", tokenizer=False)
        out += file_fuzz.fuzz_hf_folders(hf, sub, cases // 2, seed + i)
    return out


def report(kind: str, counts: Counter[str], seconds: float) -> None:
    parts = ", ".join(f"{name} {counts[name]}" for name in ("refused", "unchanged", "different") if counts[name])
    print(f"{kind:6s} {sum(counts.values()):6d} cases: {parts}; other outcomes 0 ({seconds:.0f} s)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
