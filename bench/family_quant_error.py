"""Logit error of INT8 / INT4 conversions of the tiny family vectors against their fp32 references.

    python bench/family_quant_error.py [VECTORS_DIR]   # default: ../shared/vectors next to the checkout

Prints, per family and storage, the max relative error (max |Δ| / max |ref|), the relative Frobenius
error and the top-1 agreement over every position of seqA and seqB (Ouro: default forward; Huginn:
zero state, 4 and 8 iterations).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from tinyloop.convert.from_hf import convert_hf
from tinyloop.runtime.loader import load_engine

CASES = {"ouro-tiny": [("default", 4)], "huginn-tiny": [("zeros.steps4", 4), ("zeros.steps8", 8)]}
STORAGE = {"F32": (16, None), "BF16": (16, None), "INT8": (8, None), "INT4 g32": (4, 32), "INT4 g64": (4, 64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(__file__).resolve().parents[1] / ".." / "shared" / "vectors"
    ap.add_argument("vectors", type=Path, nargs="?", default=default, help="the shared test vectors")
    root = ap.parse_args().vectors
    with tempfile.TemporaryDirectory() as scratch:
        print_table(root, Path(scratch))


def print_table(root: Path, tmp: Path) -> None:
    print("| model | storage | case | max rel err | frob rel err | top-1 agree |")
    print("|---|---|---|---|---|---|")
    for name, cases in CASES.items():
        folder = root / name
        meta = json.loads((folder / "reference.json").read_text())
        ref = load_file(str(folder / "reference.safetensors"))
        for storage, (bits, group) in STORAGE.items():
            out = tmp / f"{name}-{storage.replace(' ', '')}.tinyloop"
            fd = "BF16" if storage == "BF16" else None
            convert_hf(
                folder, out, bits, group or 64, fd, progress=False, state_start="zeros" if "huginn" in name else None
            )
            _, eng = load_engine(out, torch.device("cpu"), torch.float32)
            for case, loops in cases:
                got, want = [], []
                for seq in ("seqA", "seqB"):
                    got.append(eng.step(torch.tensor([meta["inputs"][seq]]), None, loops).logits[0].double())
                    want.append(ref[f"{seq}.{case}.logits"][0].double())
                g, w = torch.cat(got), torch.cat(want)
                max_rel = float((g - w).abs().max() / w.abs().max())
                frob = float((g - w).norm() / w.norm())
                agree = float((g.argmax(-1) == w.argmax(-1)).double().mean())
                print(f"| {name} | {storage} | {case} | {max_rel:.2e} | {frob:.2e} | {agree:.0%} |")


if __name__ == "__main__":
    main()
