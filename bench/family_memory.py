"""Peak memory of converting, loading and generating with a big checkpoint, each in a fresh process.

    python bench/family_memory.py convert HF_DIR OUT.tinyloop [convert flags...]
    python bench/family_memory.py generate FILE.tinyloop [--loops N] [--tokens N] [--dtype bf16|f32]

Prints the child's wall time and peak resident set (ru_maxrss from os.wait4, i.e. VmHWM of that process;
file-backed mapped pages that were touched count too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

GENERATE = """
import sys, time, torch, numpy as np, tinyloop as tl
path, loops, tokens, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t0 = time.perf_counter()
m = tl.Model(path, max_seq_len=64, device="cpu", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
t1 = time.perf_counter()
out = m.generate(np.arange(10, 18, dtype=np.int32), tokens, loops=loops, temperature=0)
s = m.last_stats
print(f"load {t1 - t0:.1f} s; generated {out.tolist()}; prefill {s.prefill_s:.2f} s (8 tokens), "
      f"decode {s.decode_tokens_per_s:.2f} tok/s at {loops} loops, dtype {dtype}")
"""


def run(cmd: list[str]) -> None:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    print(f"[family_memory] exit {proc.returncode}, wall {wall:.1f} s, peak RSS {usage.ru_maxrss / 2**20:.2f} GiB")
    if proc.returncode:
        sys.exit(proc.returncode)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ("convert", "generate"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    if sys.argv[1] == "convert":
        hf, out, *rest = sys.argv[2:]
        run([sys.executable, "-m", "tinyloop.cli.convert", "--from-hf", hf, "-o", out, *rest])
    else:
        args = sys.argv[2:]
        path = args[0]
        opts = dict(zip(args[1::2], args[2::2], strict=False))
        loops, tokens = opts.get("--loops", "4"), opts.get("--tokens", "4")
        run([sys.executable, "-c", GENERATE, path, loops, tokens, opts.get("--dtype", "f32")])


if __name__ == "__main__":
    main()
