"""Device probe: which flow makes a fused-decode graph capture fail (seed-407m shape, one body layer), with L2
residency on, off and alternating; run with CUDA_LOG_FILE=stdout so the driver names the call that broke it."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import threading
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_suite as gs  # noqa: E402

import tinyloop  # noqa: E402
from tinyloop.convert.random_model import write_random_model  # noqa: E402
from tinyloop.presets import preset  # noqa: E402

ONE_BODY = "/tmp/seed-1body.tinyloop"


def say(*args: object) -> None:
    print("PROBE", *args, flush=True)


def flow(path: str, l2_on: bool, tag: str) -> bool:
    env = {"TINYLOOP_DISABLE_L2_RESIDENCY": "0" if l2_on else "1"}
    gs._reset_l2()
    m = gs.with_env(env, lambda: tinyloop.Model(path, max_seq_len=1024, device="cuda"))
    step = "load"
    try:
        eng = m._engine
        vocab = m.config["vocab_size"]
        prompt = torch.as_tensor(np.random.default_rng(4).integers(0, vocab, (1, 128)), dtype=torch.long)
        cache = eng.new_cache(1, 260, 8)
        step = "prefill"
        eng.step(prompt, cache, 8, last_only=True)
        step = "raw decode"
        for _ in range(3):
            cache.truncate(128)
            for _ in range(64):
                eng.step(torch.tensor([[5]]), cache, 8, last_only=True)
        step = "generate"
        toks = m.generate(prompt[0].numpy(), 32, loops=8, temperature=0.0)
        for n in (128, 1024):
            step = f"score_last {n}"
            ids = np.random.default_rng(n).integers(0, vocab, n).astype(np.int32)
            ms = [gs.timed(lambda ids=ids: m.score_last(ids, loops=8), 1)[0] for _ in range(4)]
        window = eng.l2_window is not None
        say(tag, "ok", "window", window, "tokens", list(toks[:4]), f"{1e3 * statistics.median(ms):.2f}")
        return True
    except Exception as exc:  # noqa: BLE001
        say(tag, "FAILED at", step, type(exc).__name__, str(exc)[:300])
        say("threads", [t.name for t in threading.enumerate()])
        traceback.print_exc(limit=6)
        torch.cuda.synchronize()
        return False
    finally:
        m.close()
        torch.cuda.empty_cache()


def main() -> None:
    if not Path(ONE_BODY).exists():
        cfg = dataclasses.replace(preset("seed-407m"), n_body=1, name="seed-1body")
        write_random_model(Path(ONE_BODY), cfg, 0, 4, 64, progress=False)
    which = sys.argv[1:] or ["ab", "off", "on", "tiny_then_ab"]
    for name in which:
        say("=== sequence", name)
        if name == "ab":
            plan = [(ONE_BODY, on) for _ in range(3) for on in (False, True)]
        elif name == "off":
            plan = [(ONE_BODY, False)] * 6
        elif name == "on":
            plan = [(ONE_BODY, True)] * 6
        else:
            plan = [("tiny", on) for _ in range(2) for on in (False, True)]
            plan += [(ONE_BODY, on) for _ in range(3) for on in (False, True)]
        for i, (path, on) in enumerate(plan):
            if not flow(path, on, f"{name}#{i} {Path(path).stem} l2={'on' if on else 'off'}"):
                break


if __name__ == "__main__":
    main()
