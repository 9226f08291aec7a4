"""The persistent MLP kernel (step 1 of docs/DECODE_DATAFLOW.md) against today's two launches, on one GPU.

    PYTHONPATH=src python3 bench/persistent_mlp.py --out $OUT/persistent_mlp.json [--quick] [--only SECTION ...]

Sections, in this order (each saves the JSON so far; a failing one records its traceback and the rest still run):
- canary (always): the persistent kernel launched once per row count and residual mode in a child process with a
  time limit, so a kernel that does not compile, or a wait that never ends, is recorded instead of hanging the run;
  when it fails the persistent measurements are skipped and the default path's still run.
- layer: one layer's MLP (d_model 2048, ffn 5632, INT4 groups of 64 in the blocked layout, bfloat16), as
  seed-407m runs it (pre-norm: the result overwrites the residual) and as the Ouro-1.4B shape does (sandwich norms:
  no residual), for 1, 2 and 4 rows (--quick: 1): microseconds per layer in a chain of 64 layers inside one CUDA
  graph, the weights of 8 distinct layers cycled so that they stream from DRAM (138 MB against a 50 MB L2), today's
  two launches (the engine's own policy: Gluon / staged GEMVs, PDL) against the persistent kernel; at 2 and 4 rows
  also what the decode step runs there by default (cuBLAS on kept 16-bit copies, KernelPolicy.dense_copy_min_rows);
  the kernel's error against the two launches and float64, and whether 50 repeated launches agree (the split-K
  sums arrive in any order).
- decode: seed-407m (random INT4 weights, written to /tmp while the sections before run) decoding 128 tokens after
  a 128-token prompt at 8 loops through the public API with TINYLOOP_PERSISTENT_DECODE=0 and =1 (generate, and the
  raw decode step without sampling), and the greedy tokens of both; with --decode-tiles, also =1 under each given
  one-row tile (set in the policy the engine builds), each in a child process with a time limit.
- builtin: the built-in model's greedy tokens (32 at 8 loops, two prompts) on the GPU with and without the
  persistent kernel against the CPU path.
- tiles: seed-407m's layer (with the residual) at one row (--tile-rows) under each tile / option set of
  TILE_SWEEP (or --tiles), each checked against and timed against the two launches measured in the same child
  process; the variants run in a child process that the parent watches: one that takes longer than
  --tile-seconds (a wait that never ends) is killed and recorded, and the sweep goes on in a new child, until
  --tiles-seconds (150 s) are spent. `--only tiles` runs no canary (the sweep guards itself).
- `--render RESULT.json` prints a written result's tile sweep as a Markdown table (no GPU needed).
- ouro_decode (only when named): the Ouro-1.4B shape decoding at 4 loops, as decode (writes 1.4B random weights).
About 5-8 minutes on an H100 from a cold Triton cache, most of it compiling; split it with --only when a call's
time is short (e.g. `--only layer` then `--only decode builtin tiles`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from cuda_timing import timed
from gpu_suite import decode_timing, policy_overrides, with_env

RESULTS: dict[str, Any] = {"errors": {}}
OUT = Path("persistent_mlp.json")
SEED_PATH = "/tmp/seed-407m.tinyloop"
OURO_PATH = "/tmp/ouro-1.4b-shape.tinyloop"
D_MODEL, FFN, GROUP, EPS = 2048, 5632, 64, 1e-6
LAYER_COPIES, CHAIN = 8, 64
SECTIONS = ["layer", "decode", "builtin", "tiles", "ouro_decode"]
# Tile variants of `--only tiles`, "GU_N,GU_B,SLICE,DN_N,WARPS[,PER_SM][,field=value ...]" (kernels/policy.py
# PersistentMlpTile: gate / up rows, blocks per step, K slice, down rows, warps, programs per SM, then any field by
# name, e.g. tickets=2 or static=1), in the order they run (the sweep stops at its time cap): the default first.
_NEW = "mask_in_register=1,h_float32=1"  # the options that change no result
TILE_SWEEP = [
    "32,8,256,128,8", f"32,8,256,128,8,1,{_NEW}", f"32,8,256,128,8,1,{_NEW},x_prologue=1",
    f"32,8,256,128,16,1,{_NEW},x_prologue=1", f"32,8,256,128,32,1,{_NEW},x_prologue=1",
    f"32,8,256,256,32,1,{_NEW},x_prologue=1", f"32,8,256,128,16,1,{_NEW}", f"32,8,256,128,8,2,{_NEW},x_prologue=1",
    "32,8,256,128,32", f"32,8,256,128,16,1,{_NEW},x_prologue=1,static=1",
    f"32,8,256,128,16,1,{_NEW},x_prologue=1,static=1,prefetch_next=1",
    f"32,8,256,128,32,1,{_NEW},x_prologue=1,static=1,prefetch_next=1", f"32,8,256,256,16,1,{_NEW},x_prologue=1",
    f"16,4,256,32,8,3,{_NEW},x_prologue=1", f"16,4,256,32,8,3,{_NEW},x_prologue=1,static=1", "16,4,256,32,8,3",
    "32,8,256,128,16", "32,8,256,128,8,1,static=1", "32,8,256,128,8,1,tickets=2",
    f"16,16,256,64,8,1,{_NEW},x_prologue=1", f"16,8,256,64,4,2,{_NEW},x_prologue=1",
    f"64,4,256,64,8,1,{_NEW},x_prologue=1", f"32,8,128,256,8,1,{_NEW}", f"32,8,512,128,16,1,{_NEW},x_prologue=1",
    f"32,8,512,128,32,1,{_NEW},x_prologue=1", f"32,8,256,128,16,1,{_NEW},x_prologue=1,prefetch_next=1",
    f"32,8,256,128,32,1,{_NEW},x_prologue=1,prefetch_next=1",
]  # fmt: skip
TILES_SECONDS, TILE_SECONDS = 150.0, 45.0


def save() -> None:
    OUT.write_text(json.dumps(RESULTS, indent=1))


def section(name: str, fn: Callable[[], Any]) -> None:
    t = time.perf_counter()
    try:
        RESULTS[name] = fn()
    except Exception:
        RESULTS["errors"][name] = traceback.format_exc()
        print(f"section {name} failed:\n{RESULTS['errors'][name]}", file=sys.stderr)
    RESULTS.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t, 1)
    save()


# ---- one layer's MLP ----------------------------------------------------------------------------------------
def _policies() -> tuple[Any, Any]:
    from tinyloop.env import RuntimeEnv
    from tinyloop.kernels.cuda_backend import kernel_policy

    base = with_env({"TINYLOOP_PERSISTENT_DECODE": "0"}, lambda: kernel_policy(RuntimeEnv.read()))
    return base, dataclasses.replace(base, persistent_decode=True)


def _layers(gen: torch.Generator) -> list[tuple[Any, Any, torch.Tensor]]:
    """LAYER_COPIES distinct layers' (gate_up, down, norm weight): random codes, scales and minimums of the
    magnitude a trained layer has."""
    from tinyloop.quant import BlockedInt4Weight

    def matrix(n: int, k: int) -> BlockedInt4Weight:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        scale = (torch.rand(n, k // GROUP, device="cuda", generator=gen) * 0.004 + 0.002).half()
        return BlockedInt4Weight(codes, scale, (-7.5 * scale.float()).half(), GROUP)

    norm = lambda: (1.0 + 0.1 * torch.randn(D_MODEL, device="cuda", generator=gen)).bfloat16()  # noqa: E731
    return [(matrix(2 * FFN, D_MODEL), matrix(D_MODEL, FFN), norm()) for _ in range(LAYER_COPIES)]


def _two_launches(policy: Any) -> Callable[..., torch.Tensor]:
    from tinyloop.kernels.cuda_ops import CudaKernels

    k = CudaKernels(policy)

    def mlp(x: torch.Tensor, gate_up: Any, down: Any, norm: torch.Tensor, residual: bool) -> torch.Tensor:
        h = k.fused_linear(x, gate_up, norm_weight=norm, eps=EPS, act=k.ACT_SWIGLU)
        return k.fused_linear(h, down, residual=x, into_residual=True) if residual else k.fused_linear(h, down)

    return mlp


def _persistent(policy: Any) -> Callable[..., torch.Tensor]:
    from tinyloop.kernels.persistent_mlp import persistent_mlp

    def mlp(x: torch.Tensor, gate_up: Any, down: Any, norm: torch.Tensor, residual: bool) -> torch.Tensor:
        return persistent_mlp(policy, x, norm, EPS, gate_up, down, x if residual else None)

    return mlp


def _chain_us(mlp: Callable[..., torch.Tensor], layers: list, x0: torch.Tensor, residual: bool) -> float:
    """Microseconds per layer of CHAIN dependent MLPs (layer weights cycled) replayed as one CUDA graph."""
    x = x0.clone()

    def chain() -> None:
        y = x
        for i in range(CHAIN):
            gate_up, down, norm = layers[i % len(layers)]
            y = mlp(y, gate_up, down, norm, residual)
        if not residual:
            x.copy_(y)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()  # compiles, allocates the scratch
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.replay()
    return 1e6 * statistics.median(timed(graph.replay, 20)) / CHAIN


def _reference(x: torch.Tensor, gate_up: Any, down: Any, norm: torch.Tensor, residual: bool) -> torch.Tensor:
    x64 = x.double()
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * norm.double()
    gate, up = (h @ gate_up.dequantize(torch.float64).T).chunk(2, dim=-1)
    y = (F.silu(gate) * up) @ down.dequantize(torch.float64).T
    return x64 + y if residual else y


def _rel(a: torch.Tensor, b: torch.Tensor, kind: str = "frob") -> float:
    a, b = a.double(), b.double()
    if kind == "max":
        return float((a - b).abs().max() / b.abs().max())
    return float((a - b).norm() / b.norm())


def _check(persistent: Callable, two: Callable, layer: tuple, x: torch.Tensor, residual: bool,
           repeats: int = 50) -> dict[str, Any]:  # fmt: skip
    gate_up, down, norm = layer
    want = two(x.clone(), gate_up, down, norm, residual)
    ref = _reference(x, gate_up, down, norm, residual)
    runs = [persistent(x.clone(), gate_up, down, norm, residual) for _ in range(repeats)]
    torch.cuda.synchronize()
    return {
        "max_rel_vs_two_launches": _rel(runs[0], want, "max"),
        "rel_frob_vs_float64": _rel(runs[0], ref),
        "two_launches_rel_frob_vs_float64": _rel(want, ref),
        "repeats_distinct_results": len({r.view(torch.int16).cpu().numpy().tobytes() for r in runs}),
        "repeats_max_rel_spread": max(_rel(r, runs[0], "max") for r in runs),
    }


def layer_section(quick: bool) -> dict[str, Any]:
    from tinyloop.kernels.cuda_ops import dequantize_int4

    base, on = _policies()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = _layers(gen)
    res: dict[str, Any] = {"policy": {"pdl": base.pdl, "gluon_gemv": base.gluon_gemv, "staged_gemv": base.staged_gemv},
                           "layer_copies": LAYER_COPIES, "chain": CHAIN}  # fmt: skip
    RESULTS["layer"] = res  # saved row by row
    two, persistent = _two_launches(base), _persistent(on)
    dense = [(dequantize_int4(g, torch.bfloat16), dequantize_int4(d, torch.bfloat16), n) for g, d, n in layers]
    for case, residual in (("seed407m_prenorm", True), ("ouro_shape_sandwich", False)):
        for rows in (1,) if quick else (1, 2, 4):
            key = f"{case}_rows{rows}"
            x = torch.randn(rows, D_MODEL, device="cuda", generator=gen).bfloat16()
            row: dict[str, Any] = {"two_launches_us": _chain_us(two, layers, x, residual)}
            if base.dense_copy_min_rows and rows >= base.dense_copy_min_rows:  # the decode step's default there
                row["two_launches_16bit_copies_us"] = _chain_us(two, dense, x, residual)
            try:
                row["persistent_us"] = _chain_us(persistent, layers, x, residual)
                row.update(_check(persistent, two, layers[0], x, residual))
                row["tile"] = list(on.persistent_mlp_tile(D_MODEL, FFN, rows, GROUP))
            except Exception:
                row["persistent_error"] = traceback.format_exc()[-3000:]
            res[key] = row
            print(key, {k: v for k, v in row.items() if not k.endswith("error")}, flush=True)
            save()
    return res


def parse_tile(spec: str) -> Any:
    """A TILE_SWEEP entry as a PersistentMlpTile: positional integers, then field=value by name."""
    from tinyloop.kernels.policy import PersistentMlpTile

    parts = [p.strip() for p in spec.split(",") if p.strip()]
    positional = [int(p) for p in parts if "=" not in p]
    named: dict[str, Any] = {}
    for p in parts:
        if "=" in p:
            key, value = p.split("=", 1)
            if key not in PersistentMlpTile._fields:
                raise ValueError(f"tile {spec!r}: no field {key!r} (fields: {', '.join(PersistentMlpTile._fields)})")
            kind = type(PersistentMlpTile._field_defaults.get(key, 0))
            named[key] = bool(int(value)) if kind is bool else kind(value)
    return PersistentMlpTile(*positional, **named)


def _emit(record: dict[str, Any]) -> None:
    print("TILES " + json.dumps(record), flush=True)


def tiles_child(jobs: list[str]) -> None:
    """Child process of the tile sweep: for each job "ROWS:TILE" seed-407m's layer (with the residual) under that
    tile against today's two launches measured in this process; one line per event, so the parent can tell which
    variant never finished."""
    from tinyloop.kernels import persistent_mlp

    base, on = _policies()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = _layers(gen)
    two = _two_launches(base)
    inputs: dict[int, torch.Tensor] = {}
    for job in jobs:
        rows_text, spec = job.split(":", 1)
        rows = int(rows_text)
        if rows not in inputs:
            _emit({"start": f"two_launches_rows{rows}"})
            inputs[rows] = torch.randn(rows, D_MODEL, device="cuda", generator=gen).bfloat16()
            _emit({"baseline": rows, "two_launches_us": _chain_us(two, layers, inputs[rows], True)})
        _emit({"start": job})
        t = time.perf_counter()
        res: dict[str, Any] = {}
        try:
            tiled = dataclasses.replace(on, persistent_mlp_tiles={(D_MODEL, FFN, rows): parse_tile(spec)})
            mlp = _persistent(tiled)
            res = {"us": _chain_us(mlp, layers, inputs[rows], True), **_check(mlp, two, layers[0], inputs[rows],
                                                                             True, repeats=10)}  # fmt: skip
        except Exception:
            res = {"error": traceback.format_exc()[-2000:]}
        res["seconds"] = round(time.perf_counter() - t, 1)
        _emit({"job": job, **res})
        if "error" in res and not _cuda_usable():
            os._exit(3)  # a CUDA error poisons this process's context: the parent goes on in a new child
    _emit({"programs_one_sm_holds": {str(k): v for k, v in persistent_mlp._RESIDENT.items()}})


def _cuda_usable() -> bool:
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def tiles_section(specs: list[str], rows: list[int], total_s: float, job_s: float) -> dict[str, Any]:
    """Each tile (at each row count) timed against the two launches, in child processes: a variant that does
    not finish within `job_s` (a wait that never ends) is killed, recorded as hung, and the sweep goes on in a
    new child; what the `total_s` cap leaves unrun is recorded as such."""
    import select

    t0 = time.perf_counter()
    pending = [f"{r}:{spec}" for r in rows for spec in specs]
    for spec in specs:
        parse_tile(spec)  # a malformed entry fails here, before any child starts
    res: dict[str, Any] = {"rows": rows, "cap_s": total_s, "job_s": job_s, "two_launches_us": {}, "variants": {}}
    RESULTS["tiles"] = res
    children = 0
    while pending and time.perf_counter() - t0 < total_s:
        children += 1
        log = Path(f"/tmp/persistent_mlp_tiles_{children}.stderr")
        with log.open("w") as err:
            child = subprocess.Popen([sys.executable, __file__, "--tiles-child", *pending], stdout=subprocess.PIPE,
                                     stderr=err)  # fmt: skip
        assert child.stdout is not None
        fd = child.stdout.fileno()
        current: str | None = None
        started, buf, ended = time.perf_counter(), b"", False
        while not ended:
            now = time.perf_counter()
            limit = job_s if current and not current.startswith("two_launches") else 2 * job_s  # + CUDA start-up
            wait = min(t0 + total_s, started + limit) - now
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:  # the job's or the sweep's time is up
                child.kill()
                child.wait()
                now = time.perf_counter()
                what = current or "child start"
                over = "the sweep's time cap" if now >= t0 + total_s else f"no result in {limit:.0f} s (a hang?)"
                res["variants"][what] = {"error": over}
                if what in pending:
                    pending.remove(what)
                break
            chunk = os.read(fd, 1 << 16)
            ended = not chunk  # the child exited; what it wrote is in buf
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                if not line.startswith("TILES "):
                    continue
                rec = json.loads(line[len("TILES ") :])
                if "start" in rec:
                    current, started = rec["start"], time.perf_counter()
                elif "baseline" in rec:
                    res["two_launches_us"].setdefault(str(rec["baseline"]), []).append(rec["two_launches_us"])
                    current = None
                elif "job" in rec:
                    job = rec.pop("job")
                    base = res["two_launches_us"].get(job.split(":", 1)[0], [None])[-1]
                    if base and "us" in rec:
                        rec["speedup_vs_two_launches"] = round(base / rec["us"], 3)
                    res["variants"][job] = rec
                    pending.remove(job)
                    current = None
                    print("tile", job, rec, flush=True)
                    res["ranking"] = _ranking(res["variants"])
                    save()
                else:
                    res.update(rec)
        if ended:
            child.wait()
            if current is not None:  # it died inside a job (a crash, not a hang)
                tail = log.read_text()[-2000:]
                res["variants"][current] = {"error": f"child exited {child.returncode} during it: {tail}"}
                if current in pending:
                    pending.remove(current)
        if current is not None and current.startswith("two_launches"):
            break  # the baseline itself did not finish: nothing to compare against
    for job in pending:
        res["variants"][job] = {"error": "not run: the sweep's time cap"}
    res["children"] = children
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["ranking"] = _ranking(res["variants"])
    return res


def _agrees(rec: dict[str, Any]) -> bool:
    """A variant's result as close to the two launches and float64 as the CPU tests require of bfloat16 results
    (one bfloat16 unit; the two launches' own error), and the same bits on every repeat."""
    return (
        rec.get("max_rel_vs_two_launches", 1.0) <= 2**-7
        and rec.get("rel_frob_vs_float64", 1.0) <= 1.1 * rec.get("two_launches_rel_frob_vs_float64", 0.0) + 1e-4
        and rec.get("repeats_distinct_results") == 1
    )


def _ranking(variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed variants, fastest first, with whether each agrees with the two launches."""
    timed_ = [(rec["us"], job, rec) for job, rec in variants.items() if "us" in rec]
    return [{"job": job, "us": round(us, 2), "speedup_vs_two_launches": rec.get("speedup_vs_two_launches"),
             "agrees": _agrees(rec)} for us, job, rec in sorted(timed_)]  # fmt: skip


def canary() -> None:
    """Child process: one persistent launch per row count and residual mode, synchronised."""
    _, on = _policies()
    layers = _layers(torch.Generator(device="cuda").manual_seed(1))[:1]
    persistent = _persistent(on)
    for rows in (1, 2, 4):
        for residual in (True, False):
            x = torch.randn(rows, D_MODEL, device="cuda").bfloat16()
            persistent(x, *layers[0], residual)
            torch.cuda.synchronize()
    print("canary ok")


def canary_section(timeout: float = 300) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--canary"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no result in {timeout:.0f} s: a wait that never ends (or a very slow compile)"}
    ok = done.returncode == 0 and "canary ok" in done.stdout
    res: dict[str, Any] = {"ok": ok, "seconds": round(time.perf_counter() - t, 1)}
    if not ok:
        res["error"] = (done.stdout + done.stderr)[-4000:]
    return res


# ---- the whole decode step through the public API -------------------------------------------------------------
def make_model(preset: str, path: str) -> None:
    if not Path(path).exists():
        subprocess.run([sys.executable, "-m", "tinyloop.cli.convert", "--random", "--preset", preset, "-o", path,
                        "--bits", "4", "--quiet"], check=True)  # fmt: skip


def decode_numbers(path: str, loops: int, persistent: bool, new: int = 128, prompt_len: int = 128,
                   tile: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Decode timing through the public API; `tile` (a TILE_SWEEP entry): the persistent kernel's one-row tile
    for the model's MLP shape, set in the policy the engine builds at load."""
    import tinyloop

    def run() -> dict[str, Any]:
        m = tinyloop.Model(path, max_seq_len=1024, device="cuda")
        try:
            prompt = np.random.default_rng(1).integers(0, m.config["vocab_size"], prompt_len).astype(np.int32)
            policy = m._engine.kernel_policy
            tiles = {str(k): list(v) for k, v in policy.persistent_mlp_tiles.items()}
            res: dict[str, Any] = {"policy_persistent_decode": policy.persistent_decode, "tiles": tiles}
            return {**res, **decode_timing(m, prompt, loops, new)}
        finally:
            m.close()
            torch.cuda.empty_cache()

    fields = {} if tile is None else {"persistent_mlp_tiles": {(D_MODEL, FFN, 1): parse_tile(tile)}}
    with policy_overrides(fields):
        return with_env({"TINYLOOP_PERSISTENT_DECODE": "1" if persistent else "0"}, run)


def decode_tile_child(path: str, loops: int, tile: str) -> None:
    """Child process: one decode measurement with the persistent kernel under `tile`, as one JSON line."""
    print("DECODE " + json.dumps(decode_numbers(path, loops, True, tile=tile)), flush=True)


def _decode_tile(path: str, loops: int, tile: str, timeout: float = 180) -> dict[str, Any]:
    """decode_tile_child in a child process with a time limit (a tile whose waits never end is recorded)."""
    try:
        done = subprocess.run([sys.executable, __file__, "--decode-child", path, str(loops), tile],
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {timeout:.0f} s (a wait that never ends?)"}
    for line in done.stdout.splitlines():
        if line.startswith("DECODE "):
            return dict(json.loads(line[len("DECODE ") :]))
    return {"error": f"child exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"}


def _agreeing(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def decode_section(
    preset: str, path: str, loops: int, persistent_ok: bool, tiles: tuple[str, ...] = ()
) -> dict[str, Any]:
    make_model(preset, path)
    res: dict[str, Any] = {"loops": loops, "default": decode_numbers(path, loops, False)}
    if persistent_ok:
        try:
            res["persistent"] = decode_numbers(path, loops, True)
            res["greedy_tokens_agreeing"] = _agreeing(res["default"]["greedy"], res["persistent"]["greedy"])
            res["speedup_raw_decode"] = res["default"]["raw_decode_128_ms"] / res["persistent"]["raw_decode_128_ms"]
        except Exception:
            res["persistent_error"] = traceback.format_exc()[-3000:]
    for tile in tiles:  # each in a child process with a time limit
        rec = _decode_tile(path, loops, tile)
        if "greedy" in rec:
            rec["greedy_tokens_agreeing"] = _agreeing(res["default"]["greedy"], rec["greedy"])
            rec["speedup_raw_decode"] = res["default"]["raw_decode_128_ms"] / rec["raw_decode_128_ms"]
        res.setdefault("persistent_tiles", {})[tile] = rec
        save()
    return res


def builtin_section(persistent_ok: bool) -> dict[str, Any]:
    import tinyloop

    prompts = [np.frombuffer(p.encode(), dtype=np.uint8).astype(np.int32) for p in ("def fibonacci(n):", "class S:\n")]
    cpu = tinyloop.Model("tiny", device="cpu")
    want = [[int(t) for t in cpu.generate(p, 32, loops=8, temperature=0.0)] for p in prompts]
    cpu.close()
    res: dict[str, Any] = {"cpu_greedy": want}
    for name, on in (("default", False), ("persistent", True)):
        if on and not persistent_ok:
            continue

        def run() -> list[list[int]]:
            gpu = tinyloop.Model("tiny", device="cuda")
            try:
                return [[int(t) for t in gpu.generate(p, 32, loops=8, temperature=0.0)] for p in prompts]
            finally:
                gpu.close()

        got = with_env({"TINYLOOP_PERSISTENT_DECODE": "1" if on else "0"}, run)
        res[f"{name}_greedy_agreeing_with_cpu"] = [_agreeing(a, b) for a, b in zip(got, want, strict=True)]
        res[f"{name}_greedy"] = got
    if "persistent_greedy" in res:
        res["persistent_agreeing_with_default"] = [
            _agreeing(a, b) for a, b in zip(res["persistent_greedy"], res["default_greedy"], strict=True)
        ]
    return res


def env_section() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None)}  # fmt: skip


def render_tiles(results: dict[str, Any]) -> str:
    """The tile sweep of a written result as a Markdown table, fastest first, then what did not finish."""
    tiles = results.get("tiles")
    if not tiles:
        return "no tile sweep in this result"
    env = results.get("env", {})
    base = {rows: ", ".join(f"{us:.1f}" for us in runs) for rows, runs in tiles.get("two_launches_us", {}).items()}
    lines = [f"{env.get('device', '?')} (torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}); two "
             f"launches: {'; '.join(f'{r} row(s) {b} µs' for r, b in base.items())}", "",
             "| rows:tile | µs | vs two launches | agrees |", "|---|---|---|---|"]  # fmt: skip
    for rec in tiles.get("ranking", []):
        lines.append(f"| {rec['job']} | {rec['us']:.1f} | {rec['speedup_vs_two_launches']}x | "
                     f"{'yes' if rec['agrees'] else 'NO'} |")  # fmt: skip
    for job, rec in tiles.get("variants", {}).items():
        if "us" not in rec:
            lines.append(f"| {job} | — | {rec.get('error', '?').splitlines()[-1][:80]} | |")
    return "\n".join(lines)


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(OUT), help="the JSON file to write")
    ap.add_argument("--quick", action="store_true", help="one row count in the layer section")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS[:-1],
                    help="sections to run after the canary (default: all but ouro_decode)")  # fmt: skip
    ap.add_argument(
        "--tiles",
        nargs="+",
        default=TILE_SWEEP,
        metavar="TILE",
        help="tiles section: the variants, as 'GU_N,GU_B,SLICE,DN_N,WARPS[,PER_SM][,field=value...]'",
    )
    ap.add_argument("--tile-rows", nargs="+", type=int, default=[1], help="tiles section: row counts")
    ap.add_argument("--tiles-seconds", type=float, default=TILES_SECONDS, help="tiles section: total time cap")
    ap.add_argument(
        "--tile-seconds",
        type=float,
        default=TILE_SECONDS,
        help="tiles section: the longest one variant (compile included) may take before it counts as hung",
    )
    ap.add_argument("--canary", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiles-child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--decode-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--decode-tiles", nargs="+", default=[], metavar="TILE",
                    help="decode section: also decode with the persistent kernel under each one-row tile")  # fmt: skip
    ap.add_argument("--render", metavar="JSON", help="print a written result's tile sweep as a Markdown table (no GPU)")
    args = ap.parse_args()
    if args.render:
        print(render_tiles(json.loads(Path(args.render).read_text())))
        return
    for spec in args.tiles + args.decode_tiles:
        try:
            parse_tile(spec)
        except (ValueError, TypeError) as exc:
            sys.exit(f"bench/persistent_mlp.py: --tiles {spec!r}: {exc}")
    if not torch.cuda.is_available():
        sys.exit("bench/persistent_mlp.py: no CUDA device visible to torch; run it on the GPU machine")
    if args.canary:
        canary()
        return
    if args.tiles_child:
        tiles_child(args.tiles_child)
        return
    if args.decode_child:
        decode_tile_child(args.decode_child[0], int(args.decode_child[1]), args.decode_child[2])
        return
    OUT = Path(args.out)
    # seed-407m's random weights are written while the kernels compile and run (the converter writes atomically).
    writer = None
    if "decode" in args.only and not Path(SEED_PATH).exists():
        writer = subprocess.Popen([sys.executable, "-m", "tinyloop.cli.convert", "--random", "--preset", "seed-407m",
                                   "-o", SEED_PATH, "--bits", "4", "--quiet"])  # fmt: skip
    section("env", env_section)
    if set(args.only) - {"tiles"}:  # the tile sweep guards each variant itself
        section("canary", canary_section)
    persistent_ok = bool(RESULTS.get("canary", {}).get("ok", set(args.only) == {"tiles"}))
    if persistent_ok and "layer" in args.only:
        section("layer", lambda: layer_section(args.quick))
    if writer is not None:
        writer.wait()
    if "decode" in args.only:
        section(
            "decode_seed407m",
            lambda: decode_section("seed-407m", SEED_PATH, 8, persistent_ok, tuple(args.decode_tiles)),
        )
    if "builtin" in args.only:
        section("builtin", lambda: builtin_section(persistent_ok))
    if persistent_ok and "tiles" in args.only:
        section("tiles", lambda: tiles_section(args.tiles, args.tile_rows, args.tiles_seconds, args.tile_seconds))
    if "ouro_decode" in args.only:
        section("decode_ouro_shape", lambda: decode_section("ouro-1.4b-shape", OURO_PATH, 4, persistent_ok))
    print(json.dumps({k: v for k, v in RESULTS.items() if k != "layer"}, indent=1)[:6000])


if __name__ == "__main__":
    main()
