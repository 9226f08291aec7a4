"""Issue-6 measurements on the built-in model (CPU): lens cost vs plain scoring, token-exit agreement.

PYTHONPATH=src python bench/introspection.py --corpus .carry/corpus --out runs/introspection.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import tinyloop
from tinyloop.runtime.token_exit import score_with_token_exit


def median_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", type=Path, default=Path(".carry/corpus"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--loops", type=int, default=8)
    args = ap.parse_args()
    val = np.frombuffer((args.corpus / "val.bin").read_bytes(), dtype=np.uint8)
    results: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    with tinyloop.Model("tiny", max_seq_len=1024, device="cpu") as m:
        window = val[1000:1512].astype(np.int32)
        t_score = median_time(lambda: m.score(window, loops=args.loops), 5)
        t_lens = median_time(lambda: m.score_logit_lens(window, loops=args.loops), 5)
        results["lens_cost"] = {"bytes": 512, "loops": args.loops, "score_s": t_score, "lens_s": t_lens,
                                "ratio": t_lens / t_score}  # fmt: skip
        print("lens/score", t_lens / t_score, flush=True)
        offsets = np.linspace(0, len(val) - 513, args.windows).astype(int)
        exits = {}
        for patience in (1, 2, 3):
            agree = total = exited = 0
            saved = []
            for off in offsets:
                ids = val[off : off + 512].astype(np.int64)
                full = m.score(ids, loops=args.loops).argmax(-1)
                res = score_with_token_exit(m._engine, torch.from_numpy(ids), args.loops, patience)
                early = (res.exit_depth < args.loops).numpy()
                got = res.logits.float().argmax(-1).numpy()
                agree += int((got[early] == full[early]).sum())
                exited += int(early.sum())
                total += len(ids)
                saved.append(res.body_fraction_saved)
            t_plain = median_time(lambda ids=ids: m.score(ids, loops=args.loops), 3)
            t_exit = median_time(
                lambda ids=ids, p=patience: score_with_token_exit(m._engine, torch.from_numpy(ids), args.loops, p), 3
            )
            exits[patience] = {
                "positions": total, "exited_early": exited,
                "argmax_agreement_of_exited": agree / max(exited, 1),
                "body_compute_saved": float(np.mean(saved)), "plain_s": t_plain, "token_exit_s": t_exit,
            }  # fmt: skip
            print("patience", patience, exits[patience], flush=True)
        results["token_exit"] = exits
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
