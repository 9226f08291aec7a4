"""The persistent MLP kernel compiled offline for sm_90 (no GPU, no torch): registers, spills, and SASS
instructions and barriers per loop for tile variants — how docs/DECODE_DATAFLOW.md's instruction counts were read.

    <python with the GPU's Triton> bench/persistent_mlp_sass.py [--tiles TILE ...] [--rows N] [--json]

TILE as in bench/persistent_mlp.py ("GU_N,GU_B,SLICE,DN_N,WARPS[,PER_SM][,field=value ...]"). The kernel modules
are loaded from src/ without the tinyloop package (whose import needs torch), so any Python with Triton and its
bundled ptxas / cuobjdump runs this. The launch's specialisation is reproduced for seed-407m's MLP (d_model 2048,
ffn 5632, INT4 groups of 64, bfloat16): arguments divisible by 16 marked so, one row a constant.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
D_MODEL, FFN, GROUP, BLOCK = 2048, 5632, 64, 64
PROGRAMS = 132
NIBBLE_MASK = 0x00780000
DEFAULT_TILES = [
    "32,8,256,128,8",
    "32,8,256,128,8,1,mask_in_register=1,h_float32=1",
    "32,8,256,128,8,1,mask_in_register=1,h_float32=1,x_prologue=1",
    "32,8,256,128,16,1,mask_in_register=1,h_float32=1,x_prologue=1",
    "16,4,256,32,8,3,mask_in_register=1,h_float32=1,x_prologue=1",
]
# PersistentMlpTile's fields (kernels/policy.py) -> the kernel's compile-time arguments
POSITIONAL = ["GU_N", "GU_B", "SLICE", "DN_N", "num_warps", "programs_per_sm"]
NAMED = {"tickets": "TICKETS", "static": "STATIC", "x_prologue": "XPRO", "mask_in_register": "MASK_ARG",
         "h_float32": "H32", "prefetch_next": "PREFETCH"}  # fmt: skip


def kernel_module(name: str = "tinyloop.kernels.triton_persistent_mlp") -> types.ModuleType:
    """A module of src/tinyloop/kernels (default: triton_persistent_mlp.py) imported with stand-ins for the
    packages above it."""
    for package_name, path in (("tinyloop", SRC / "tinyloop"), ("tinyloop.kernels", SRC / "tinyloop" / "kernels")):
        if package_name not in sys.modules:
            package = types.ModuleType(package_name)
            package.__path__ = [str(path)]
            sys.modules[package_name] = package
    import importlib

    return importlib.import_module(name)


def parse_tile(spec: str) -> dict[str, Any]:
    values: dict[str, Any] = {"TICKETS": 1, "STATIC": False, "XPRO": 0, "MASK_ARG": False, "H32": False,
                              "PREFETCH": False}  # fmt: skip
    positional = [p.strip() for p in spec.split(",") if p.strip() and "=" not in p]
    for key, text in zip(POSITIONAL, positional, strict=False):
        values[key] = int(text)
    for part in spec.split(","):
        if "=" in part:
            key, text = (t.strip() for t in part.split("=", 1))
            if key not in NAMED:
                raise SystemExit(
                    f"persistent_mlp_sass.py: tile {spec!r}: no option {key!r} (options: {', '.join(NAMED)})"
                )
            values[NAMED[key]] = int(text) if NAMED[key] in ("TICKETS", "XPRO") else bool(int(text))
    if len(positional) < 5:
        raise SystemExit(f"persistent_mlp_sass.py: tile {spec!r}: expected at least GU_N,GU_B,SLICE,DN_N,WARPS")
    return values


def compile_tile(module: types.ModuleType, spec: str, rows: int) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = module._persistent_mlp_kernel
    tile = parse_tile(spec)
    warps = tile.pop("num_warps")
    tile.pop("programs_per_sm", None)
    rows_pow2 = 1 << (rows - 1).bit_length()
    constants = dict(GROUP=GROUP, BLOCK=BLOCK, RESIDUAL=True, ROWS=rows_pow2, PDL=1, THREADS=32 * warps, **tile)
    constants = {k: v for k, v in constants.items() if k in kernel.arg_names}  # an older kernel has fewer
    # The launch's integer arguments (seed-407m, pre-norm: the result into the residual)
    ints = {"M": rows, "F": FFN, "D": D_MODEL, "stride_xm": D_MODEL, "stride_hm": FFN, "stride_om": D_MODEL,
            "stride_rm": D_MODEL, "stride_gu_w": D_MODEL // 8, "stride_gu_g": D_MODEL // GROUP,
            "stride_dn_w": FFN // 8, "stride_dn_g": FFN // GROUP, "n_programs": PROGRAMS,
            "nibble_mask": NIBBLE_MASK}  # fmt: skip
    pointers = {"x_ptr": "*bf16", "nw_ptr": "*bf16", "gu_ptr": "*i32", "gu_s_ptr": "*fp16", "gu_m_ptr": "*fp16",
                "dn_ptr": "*i32", "dn_s_ptr": "*fp16", "dn_m_ptr": "*fp16",
                "h_ptr": "*fp32" if tile["H32"] else "*bf16", "acc_ptr": "*fp32", "out_ptr": "*bf16",
                "res_ptr": "*bf16", "sync_ptr": "*i32", "xn_ptr": "*fp32"}  # fmt: skip
    signature: dict[str, str] = {}
    attrs = {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name == "eps":
            signature[name] = "fp32"
        elif ints[name] == 1:  # the launch makes an argument of 1 a constant
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()},
                       attrs=attrs)  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    usage, sass = resources_and_sass(compiled)
    return {"tile": spec, "rows": rows, **usage, "instructions": len(_instructions(sass)), "loops": _loops(sass)}


def resources_and_sass(compiled: Any) -> tuple[dict[str, int], str]:
    """A compiled kernel's registers, stack and local bytes a thread (-1 where cuobjdump says nothing), and its
    SASS, read with the cuobjdump bundled with Triton."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    registers, stack, _, local = (int(g) for g in found.groups()) if found else (-1, -1, -1, -1)
    return {"registers": registers, "stack_bytes": stack, "local_bytes": local}, sass


def _instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each SASS instruction."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def _loops(sass: str) -> list[dict[str, Any]]:
    """Each backward branch's body: instructions, barriers, global loads and the most frequent opcodes."""
    instructions = _instructions(sass)
    where = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        m = re.search(r"\bBRA(?:\.U)?\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address and int(m.group(1), 16) in where:
            body = [t for _, t in instructions[where[int(m.group(1), 16)] : i + 1]]
            ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)
            loops.append({"instructions": len(body), "barriers": sum(v for k, v in ops.items() if k.startswith("BAR")),
                          "global_loads": sum(v for k, v in ops.items() if k.startswith("LDG")),
                          "tensor_core": sum(v for k, v in ops.items() if k.startswith(("HMMA", "HGMMA"))),
                          "top": dict(ops.most_common(8))})  # fmt: skip
    return loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiles", nargs="+", default=DEFAULT_TILES, metavar="TILE")
    ap.add_argument("--rows", type=int, default=1, choices=(1, 2, 3, 4))
    ap.add_argument("--json", action="store_true", help="one JSON object per tile instead of a summary")
    args = ap.parse_args()
    try:
        import triton
    except ImportError:
        sys.exit("persistent_mlp_sass.py: needs Triton (with its bundled ptxas / cuobjdump) in this Python")
    module = kernel_module()
    for spec in args.tiles:
        res = compile_tile(module, spec, args.rows)
        res["triton"] = triton.__version__
        if args.json:
            print(json.dumps(res))
            continue
        print(f"{spec} (rows {args.rows}): {res['registers']} registers, {res['stack_bytes']} bytes stack, "
              f"{res['instructions']} instructions")  # fmt: skip
        for loop in res["loops"]:
            if loop["instructions"] > 40:  # the item loops, not the spin waits
                print(f"  loop: {loop['instructions']} instructions, {loop['barriers']} barriers, "
                      f"{loop['global_loads']} global loads; {loop['top']}")  # fmt: skip


if __name__ == "__main__":
    main()
