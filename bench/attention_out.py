"""One-token attention fused with the output projection (`KernelPolicy.attention_out_max_rows`,
kernels/attention_out.py) against the two launches it replaces, on one GPU.

    PYTHONPATH=src python bench/attention_out.py --model seed.tinyloop --out F.json [--loops 8] \\
        [--tiles 64,256,4 64,128,4] [--builtin]

For the default path and the fused kernel under each tile (keys per block, output rows per program, warps), in
turn and then the default again (drift): greedy `generate` of 128 tokens after a 128-token random prompt and the
raw decode steps (gpu_suite.decode_timing), and how many greedy tokens agree with the default path's. --builtin:
the built-in model's greedy tokens (two prompts, 32 tokens, 8 loops) on the GPU, default and fused, against the CPU.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch
from gpu_batched_decode import leading_equal, parse_overrides
from gpu_suite import decode_timing, policy_overrides

import tinyloop


def decode(path: str, loops: int, fields: dict[str, Any]) -> dict[str, Any]:
    with policy_overrides(fields):
        model = tinyloop.Model(path, max_seq_len=1024, device="cuda")
        try:
            prompt = np.random.default_rng(1).integers(0, model.config["vocab_size"], 128).astype(np.int32)
            return decode_timing(model, prompt, loops)
        finally:
            model.close()
            torch.cuda.empty_cache()


def builtin(fields: dict[str, Any]) -> dict[str, Any]:
    prompts = [np.frombuffer(p.encode(), dtype=np.uint8).astype(np.int32) for p in ("def fibonacci(n):", "class S:\n")]
    res: dict[str, Any] = {}
    for name, device, over in (("cpu", "cpu", {}), ("gpu_default", "cuda", {}), ("gpu_fused", "cuda", fields)):
        with policy_overrides(over):
            model = tinyloop.Model("tiny", device=device)
            try:
                res[name] = [[int(t) for t in model.generate(p, 32, loops=8, temperature=0.0)] for p in prompts]
            finally:
                model.close()
    for name in ("gpu_default", "gpu_fused"):
        res[f"{name}_agreeing_with_cpu"] = [leading_equal(np.array(a), np.array(b))
                                             for a, b in zip(res[name], res["cpu"], strict=True)]  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--tiles", nargs="*", default=["64,256,4"], help="keys per block,output rows,warps")
    ap.add_argument("--builtin", action="store_true")
    args = ap.parse_args()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": {}}

    def record(name: str, fields: dict[str, Any]) -> None:
        run = decode(args.model, args.loops, fields)
        if "default" in result["runs"]:
            default = np.array(result["runs"]["default"]["greedy"])
            run["greedy_agreeing_with_default"] = leading_equal(np.array(run["greedy"]), default)
        result["runs"][name] = run
        print(name, {k: v for k, v in run.items() if k != "greedy"}, flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    record("default", {})
    for tile in args.tiles:
        record(f"fused {tile}", parse_overrides(["attention_out_max_rows=1", f"attention_out_tile={tile}"], None))
    record("default again", {})
    if args.builtin:
        result["builtin"] = builtin(parse_overrides(["attention_out_max_rows=1", f"attention_out_tile={args.tiles[0]}"],
                                                    None))  # fmt: skip
        print("builtin", {k: v for k, v in result["builtin"].items() if "agreeing" in k}, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
