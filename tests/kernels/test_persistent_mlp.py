"""The persistent MLP kernel (kernels/triton_persistent_mlp.py) in Triton's interpreter: one program takes every
work item in ticket order and never waits, so these run the real item code, counters and split-K finalisation
(the interleavings of many programs are checked on the GPU: bench/persistent_mlp.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import frob_rel_error, interpreter_policy, max_rel_error
from tinyloop.env import RuntimeEnv
from tinyloop.kernels import cuda_backend, persistent_mlp
from tinyloop.kernels.cuda_ops import CudaKernels
from tinyloop.kernels.policy import KernelPolicy, PersistentMlpTile
from tinyloop.quant import BlockedInt4Weight, quantize_int4

EPS = 1e-6
# (d_model, ffn, group): test-tiny (groups of 32), the built-in model, and seed-407m's d_model with its ffn cut to
# 256 features (seed-407m: 5632) so that the interpreter stays quick.
SHAPES = {"test-tiny": (64, 128, 32), "builtin": (384, 1024, 64), "seed-407m-slice": (2048, 256, 64)}
# Few large items for the interpreter, which pays per operation, not per byte (the GPU tiles take 15-20 s here);
# still several K slices with several producers each, and several output tiles per slice. test-tiny: the GPU rule.
INTERPRETER_TILES = {"builtin": PersistentMlpTile(128, 8, 256, 128, 8),
                     "seed-407m-slice": PersistentMlpTile(64, 32, 128, 512, 8)}  # fmt: skip
# The two-launch path in the interpreter: wide programs (the GPU tiles take minutes here).
TWO_LAUNCH_TILES = {(n, k, r): (256, 32, 4) for n in (64, 128, 256, 384, 1024, 2048) for k in (64, 128, 256, 384,
                    1024, 2048) for r in (1, 2, 3, 4)}  # fmt: skip


def _policy(shape: str, rows: int) -> KernelPolicy:
    d, f, _ = SHAPES[shape]
    tiles = {(d, f, rows): INTERPRETER_TILES[shape]} if shape in INTERPRETER_TILES else {}
    return KernelPolicy(persistent_decode=True, persistent_mlp_tiles=tiles)


def _weights(d: int, f: int, group: int, seed: int) -> tuple[BlockedInt4Weight, BlockedInt4Weight, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = quantize_int4(torch.randn(2 * f, d, generator=gen) / d**0.5, group)
    down = quantize_int4(torch.randn(d, f, generator=gen) / f**0.5, group)
    norm = 1.0 + 0.1 * torch.randn(d, generator=gen)
    return BlockedInt4Weight.from_int4(gate_up), BlockedInt4Weight.from_int4(down), norm


def _reference(x: torch.Tensor, norm: torch.Tensor, gate_up: BlockedInt4Weight, down: BlockedInt4Weight,
               residual: bool) -> torch.Tensor:  # fmt: skip
    x64 = x.double()
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * norm.double()
    gate, up = (h @ gate_up.dequantize(torch.float64).T).chunk(2, dim=-1)
    y = (F.silu(gate) * up) @ down.dequantize(torch.float64).T
    return x64 + y if residual else y


def _two_launches(x: torch.Tensor, norm: torch.Tensor, gate_up: BlockedInt4Weight, down: BlockedInt4Weight,
                  residual: bool) -> torch.Tensor:  # fmt: skip
    """Today's decode path: the fused gate / up + SwiGLU GEMV, then the down GEMV with the residual."""
    k = CudaKernels(interpreter_policy(blocked_tiles=TWO_LAUNCH_TILES))  # type: ignore[arg-type]
    h = k.fused_linear(x, gate_up, norm_weight=norm, eps=EPS, act=k.ACT_SWIGLU)
    return k.fused_linear(h, down, residual=x.clone()) if residual else k.fused_linear(h, down)


CASES = [
    ("test-tiny", 1, torch.float32, True),
    ("test-tiny", 3, torch.float32, False),
    ("builtin", 1, torch.float32, True),
    ("builtin", 2, torch.bfloat16, True),
    ("seed-407m-slice", 1, torch.bfloat16, True),
    ("seed-407m-slice", 4, torch.float32, False),
]


@pytest.mark.parametrize(("shape", "rows", "dtype", "residual"), CASES)
def test_persistent_mlp_matches_the_two_launches_and_the_reference(
    shape: str, rows: int, dtype: torch.dtype, residual: bool
) -> None:
    d, f, group = SHAPES[shape]
    gate_up, down, norm = _weights(d, f, group, seed=rows)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    norm = norm.to(dtype)
    policy = _policy(shape, rows)
    assert persistent_mlp.persistent_mlp_applies(policy, x, gate_up, down)
    res = x.clone() if residual else None
    got = persistent_mlp.persistent_mlp(policy, x, norm, EPS, gate_up, down, res)
    assert (got is res) == residual  # with a residual the result takes its storage, as the down GEMV's does
    want = _two_launches(x, norm, gate_up, down, residual)
    ref = _reference(x, norm, gate_up, down, residual)
    if dtype == torch.float32:  # only the order of the split-K sums differs
        assert max_rel_error(got, want) <= 1e-5
        assert frob_rel_error(got, ref) <= 1e-5
    else:  # ... which may move a bfloat16 rounding by one unit
        assert max_rel_error(got, want) <= 2**-7
        assert frob_rel_error(got, ref) <= 1.1 * frob_rel_error(want, ref) + 1e-4
    # The launch left its scratch ready for the next one (a graph replays it without a reset).
    tile = policy.persistent_mlp_tile(d, f, rows, group)
    assert tile is not None
    _, acc, sync, _ = persistent_mlp._scratch(x, f, tile)
    assert not acc.any() and not sync.any()
    again = persistent_mlp.persistent_mlp(policy, x, norm, EPS, gate_up, down, x.clone() if residual else None)
    assert torch.equal(again, got)


# Options of the tile (kernels/policy.py PersistentMlpTile): items per ticket, items dealt statically, the nibble
# mask in a register, h in float32: the same operations in the same order (one program takes the items in ticket
# order whatever the schedule), so the same bits. The x prologue sums x * g and x * x in another order.
OPTIONS = [{"tickets": 2}, {"tickets": 3}, {"static": True}, {"static": True, "tickets": 2},
           {"mask_in_register": True}, {"h_float32": True}, {"x_prologue": True},
           {"x_prologue": True, "static": True, "tickets": 2, "mask_in_register": True, "h_float32": True},
           {"static": True, "prefetch_next": True}]  # fmt: skip


@pytest.mark.parametrize("option", OPTIONS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize(("shape", "rows", "dtype"), [("builtin", 2, torch.bfloat16), ("test-tiny", 3, torch.float32)])
def test_tile_options_give_the_same_result(
    option: dict[str, object], shape: str, rows: int, dtype: torch.dtype
) -> None:
    d, f, group = SHAPES[shape]
    gate_up, down, norm = _weights(d, f, group, seed=5)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(9)).to(dtype)
    norm = norm.to(dtype)
    default = _policy(shape, rows)
    base = default.persistent_mlp_tile(d, f, rows, group)
    assert base is not None
    tile = base._replace(**option)
    policy = KernelPolicy(persistent_decode=True, persistent_mlp_tiles={(d, f, rows): tile})
    want = persistent_mlp.persistent_mlp(default, x, norm, EPS, gate_up, down, x.clone())
    got = persistent_mlp.persistent_mlp(policy, x, norm, EPS, gate_up, down, x.clone())
    if tile.x_prologue:
        assert max_rel_error(got, want) <= (1e-5 if dtype == torch.float32 else 2**-7)
        assert frob_rel_error(got, _two_launches(x, norm, gate_up, down, True)) <= (
            1e-5 if dtype == torch.float32 else 1e-2
        )
    else:
        assert torch.equal(got, want)
    _, acc, sync, _ = persistent_mlp._scratch(x, f, tile)
    assert not acc.any() and not sync.any()
    again = persistent_mlp.persistent_mlp(policy, x, norm, EPS, gate_up, down, x.clone())
    assert torch.equal(again, got)  # the launch left its scratch ready for the next


def test_prefetching_is_never_interpreted() -> None:
    """The L2 prefetch of weights is inline PTX: never in the interpreter (the option's results above are the
    kernel's without it; on the device bench/persistent_mlp.py's sweep checks them)."""
    gate_up, down, _ = _weights(64, 128, 32, seed=0)
    for static in (True, False):
        tile = PersistentMlpTile(32, 2, 64, 64, 4, static=static, prefetch_next=True)
        assert not persistent_mlp._prefetches(tile, torch.zeros(1, 64), gate_up, down)  # not a CUDA tensor


def test_builtin_models_own_layer() -> None:
    """A body layer of the built-in model (its trained weights), one and two rows."""
    from tinyloop.builtin import resolve_model
    from tinyloop.format.reader import load_weights, read_header
    from tinyloop.quant import Int4Weight

    path = resolve_model("tiny")
    _, flat = load_weights(path, device="cpu", header=read_header(path))
    gate_up, down = (flat[f"body.0.mlp.{n}.weight"] for n in ("gate_up", "down"))
    assert type(gate_up) is Int4Weight and type(down) is Int4Weight
    gate_up, down = BlockedInt4Weight.from_int4(gate_up), BlockedInt4Weight.from_int4(down)
    norm = flat["body.0.mlp_norm.weight"].float()
    x = torch.randn(2, 384, generator=torch.Generator().manual_seed(3))
    for rows in (1, 2):
        policy = _policy("builtin", rows)
        got = persistent_mlp.persistent_mlp(policy, x[:rows], norm, EPS, gate_up, down, x[:rows].clone())
        assert max_rel_error(got, _two_launches(x[:rows], norm, gate_up, down, True)) <= 1e-5
        assert frob_rel_error(got, _reference(x[:rows], norm, gate_up, down, True)) <= 1e-5


def test_where_the_persistent_kernel_applies() -> None:
    gate_up, down, _ = _weights(64, 128, 64, seed=0)
    on, off = KernelPolicy(persistent_decode=True), KernelPolicy()
    x = torch.randn(1, 64)
    assert persistent_mlp.persistent_mlp_applies(on, x, gate_up, down)
    assert not persistent_mlp.persistent_mlp_applies(off, x, gate_up, down)
    assert not persistent_mlp.persistent_mlp_applies(on, torch.randn(5, 64), gate_up, down)  # not decode-sized
    assert not persistent_mlp.persistent_mlp_applies(on, x, gate_up.dequantize(), down)  # 16-bit weights
    plain = quantize_int4(torch.randn(64, 128), 64)
    assert not persistent_mlp.persistent_mlp_applies(on, x, gate_up, plain)  # the file's plain INT4 layout
    odd_ffn, odd_down, _ = _weights(64, 96, 32, seed=0)  # no K slice of 64-256 features divides 96
    assert not persistent_mlp.persistent_mlp_applies(on, x, odd_ffn, odd_down)


@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("", False)])
def test_the_environment_switches_it(value: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYLOOP_PERSISTENT_DECODE", value)
    assert cuda_backend.kernel_policy(RuntimeEnv.read()).persistent_decode == on


def test_programs_per_sm_are_capped_at_what_one_sm_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """More than one program per SM only as far as the compiled kernel's registers, threads and shared memory let
    them all be resident; one per SM where the kernel cannot be inspected."""
    from types import SimpleNamespace

    compiled = SimpleNamespace(n_regs=121, metadata=SimpleNamespace(shared=50_000), _init_handles=lambda: None)
    kernel = SimpleNamespace(warmup=lambda *a, **k: compiled)
    props = SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            shared_memory_per_multiprocessor=233_472)  # fmt: skip
    monkeypatch.setattr(persistent_mlp, "_persistent_mlp_kernel", kernel)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(persistent_mlp, "_RESIDENT", {})
    x = torch.zeros(1, 8)
    # 128 registers x 256 threads: 2 by registers; 8 by threads; 4 by shared memory
    assert persistent_mlp._resident_per_sm((x,), {"num_warps": 8, "ROWS": 1}, 0) == 2
    compiled.metadata.shared = 100_000  # 2 by shared memory
    assert persistent_mlp._resident_per_sm((x,), {"num_warps": 4, "ROWS": 1}, 0) == 2
    said: list[str] = []
    monkeypatch.setattr(persistent_mlp, "info", said.append)
    monkeypatch.setattr(kernel, "warmup", lambda *a, **k: 1 / 0)
    assert persistent_mlp._resident_per_sm((x,), {"num_warps": 2, "ROWS": 1}, 0) == 1
    assert said and "one program per SM" in said[0]
