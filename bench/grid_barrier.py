"""What a grid-wide barrier inside one persistent kernel costs on the GPU, against a kernel boundary in a CUDA
graph (with and without programmatic dependent launch): the question a persistent decode-layer kernel hangs on.

    PYTHONPATH=src python3 bench/grid_barrier.py [--rounds 2000] [--json out.json]

Each round every program writes one value, passes the barrier (or the kernel ends and the next one starts),
and reads another program's value of that round; a wrong read is counted, so the barrier is checked as it is
timed. Prints microseconds per round for 1 and 2 programs per SM.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _grid_sync(sync_ptr, n_programs):
    """Every program waits here until all n_programs arrived. sync_ptr: int32 [2] (arrivals, generation),
    zero before the first use; the last to arrive resets the arrivals and bumps the generation, so the pair
    is ready for the next barrier (and the next launch or graph replay) without a reset."""
    tl.debug_barrier()  # this program's writes are done before it says it arrived
    generation = tl.atomic_add(sync_ptr + 1, 0, sem="relaxed")
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    if arrived == n_programs - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        while tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == generation:
            pass
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(buf_ptr, err_ptr, sync_ptr, rounds, n_programs):
    pid = tl.program_id(0)
    neighbour = (pid + 1) % n_programs
    for r in range(rounds):
        slot = buf_ptr + (r % 2) * n_programs
        tl.store(slot + pid, r * n_programs + pid)
        _grid_sync(sync_ptr, n_programs)
        seen = tl.load(slot + neighbour, cache_modifier=".cg")
        if seen != r * n_programs + neighbour:
            tl.atomic_add(err_ptr, 1)


@triton.jit
def _round_kernel(buf_ptr, err_ptr, r, n_programs, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    neighbour = (pid + 1) % n_programs
    prev = buf_ptr + ((r + 1) % 2) * n_programs
    if r > 0:
        seen = tl.load(prev + neighbour, cache_modifier=".cg")
        if seen != (r - 1) * n_programs + neighbour:
            tl.atomic_add(err_ptr, 1)
    tl.store(buf_ptr + (r % 2) * n_programs + pid, r * n_programs + pid)


def _time(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {}
    for per_sm in (1, 2):
        P = sms * per_sm
        buf = torch.zeros(2 * P, dtype=torch.int32, device="cuda")
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        sync = torch.zeros(2, dtype=torch.int32, device="cuda")
        us = _time(functools.partial(_persistent_kernel[(P,)], buf, err, sync, args.rounds, P, num_warps=4))
        results[f"barrier_{per_sm}_per_sm_us"] = us / args.rounds
        results[f"barrier_{per_sm}_per_sm_errors"] = int(err.item())
        for pdl in (False, True):
            err.zero_()
            rounds = min(args.rounds, 500)
            extra = {"launch_pdl": True} if pdl else {}
            graph = torch.cuda.CUDAGraph()
            _round_kernel[(P,)](buf, err, 0, P, PDL=pdl, num_warps=4, **extra)  # compile outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                for r in range(rounds):
                    _round_kernel[(P,)](buf, err, r, P, PDL=pdl, num_warps=4, **extra)
            err.zero_()
            us = _time(graph.replay)
            key = f"launch_{per_sm}_per_sm_{'pdl' if pdl else 'plain'}"
            results[key + "_us"] = us / rounds
            results[key + "_errors"] = int(err.item())
    for k, v in results.items():
        print(f"{k:36s} {v:.3f}" if isinstance(v, float) else f"{k:36s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
