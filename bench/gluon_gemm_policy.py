"""seed-407m prefill (score_last, loops 8) with the Gluon INT4 GEMM off, on for every product, and on only where K
is at least twice N (cuda_ops.GLUON_GEMM_MIN_K_OVER_N = 2: the down projection), fresh models alternated twice
(gpu_suite._prefill_on_off): `PYTHONPATH=src python bench/gluon_gemm_policy.py --out $OUT/policy.json`."""

from __future__ import annotations

import argparse
import json

from gpu_suite import _PROCS, SEED_PATH, _prefill_on_off, make_models

from tinyloop.kernels import cuda_ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="*", default=[128])
    args = ap.parse_args()
    for path, proc in make_models().items():  # the suite's random model files; only seed-407m is needed
        if path == SEED_PATH:
            _PROCS[path] = proc
        else:
            proc.kill()
    res = {}
    for label, ratio in (("all", 0.0), ("k_over_n_2", 2.0)):

        def switch(on: bool, ratio: float = ratio) -> None:
            cuda_ops.USE_GLUON_GEMM = on
            cuda_ops.GLUON_GEMM_MIN_K_OVER_N = ratio

        res[label] = _prefill_on_off(switch, f"gluon_gemm_{label}", tuple(args.rows))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
