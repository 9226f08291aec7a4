"""Check prefix caches, pools and resume handles in every KV mode on a device (e.g. CUDA, bf16): greedy
tokens from each path vs a fresh run, and first-step logit differences. Prints JSON.

    PYTHONPATH=src python bench/caches_device_check.py --device cuda [--model FILE.tinyloop]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from caches import model_file, val_bytes  # noqa: E402

from tinyloop.api.model import Model  # noqa: E402
from tinyloop.cache.pool import PrefixPool  # noqa: E402


def agree(a: np.ndarray, b: np.ndarray) -> int:
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else len(a)


def check(path: Path, device: str, n: int) -> dict[str, dict[str, int]]:
    text = val_bytes()
    prefix, suffix = text[2000:2300], text[9000:9020]
    prompt = np.concatenate([prefix, suffix])
    out = {}
    for mode, window in [("16bit", 0), ("int8", 0), ("hidden", 0), ("window", 64), ("none", 0)]:
        res: dict[str, int] = {}
        with Model(path, max_seq_len=512, device=device, kv_mode=mode, cache_window=window) as m:
            fresh = m.generate(prompt, n, 8, temperature=0.0)
            if mode != "none":
                pc = m.build_prefix_cache(prefix, 8)
                res["prefix_cache"] = agree(m.generate_from_prefix_cache(pc, suffix, n, 8, temperature=0.0), fresh)
                pool = PrefixPool()
                m.register_prefix(pool, pc)
                res["pool_shorter_entry"] = agree(m.generate_with_pool(pool, prompt, n, 8, temperature=0.0), fresh)
                head = prefix[:200]
                res["pool_longer_entry"] = agree(
                    m.generate_with_pool(pool, head, n, 8, temperature=0.0), m.generate(head, n, 8, temperature=0.0)
                )
            handle = m.build_resume_handle(prompt, 4)
            res["resume_4_to_8"] = agree(m.resume_generate(handle, 8, n, temperature=0.0), fresh)
            res["of"] = n
        out[mode] = res
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path, what = model_file(args.model, Path(tmp))
        print(
            json.dumps(
                {"model": what, "device": args.device, "greedy_agreement": check(path, args.device, args.tokens)},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
