"""The looped forward pass: embedding -> prelude -> body x L (with injection) -> coda -> head.

The one place the architecture is interpreted (injection, loop norm, norm placement, state start, exit gate,
stochastic rounding's per-iteration weights). It is written over a `ForwardOps` backend (model/ops.py):
the torch reference here, the CPU decode step and the CUDA kernels in runtime/ run this same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinyloop.config import ArchConfig
from tinyloop.model.cross_iter import at_iteration, has_cross_iter
from tinyloop.model.layers import StepContext, norm
from tinyloop.model.ops import ForwardOps, TorchOps, gate_logit
from tinyloop.model.slots import body_slot, coda_slot, prelude_slot
from tinyloop.model.weights import LayerWeights, ModelWeights, Norm

__all__ = ["ForwardOutput", "IterationView", "forward", "gate_logit", "run", "token_exit_forward"]


@dataclass
class ForwardOutput:
    """logits: [B, T', V] float32 (T' = T, or 1 per row when only the last position was asked).

    states (when asked): embedding output, prelude output, then the loop state after each iteration
    (a resumed forward lists only the iterations it ran).
    gates (when the model has an exit gate): the gate's logit after each iteration run, [B, T].
    loop_state / prelude_out: the final loop state and the prelude output [B, T, d] (references, free),
    which is what a later forward needs to resume deeper (`resume_at`).
    """

    logits: torch.Tensor | None
    states: list[torch.Tensor] | None = None
    gates: list[torch.Tensor] = field(default_factory=list)
    loop_state: torch.Tensor | None = None
    prelude_out: torch.Tensor | None = None

    def resume_at(self, loops: int) -> Resume:
        """Where this forward, which ran `loops` iterations, leaves off for a deeper one."""
        assert self.loop_state is not None and self.prelude_out is not None
        return Resume(self.loop_state, self.prelude_out, loops)


@dataclass(frozen=True)
class Resume:
    """The loop state and prelude output ([B, T, d]) of a forward that ran `start_loop` iterations over some
    positions; a forward resumed from it runs iterations start_loop.., the coda and the head there."""

    loop_state: torch.Tensor
    prelude_out: torch.Tensor
    start_loop: int

    def to(self, device: torch.device, dtype: torch.dtype) -> Resume:
        return Resume(self.loop_state.to(device, dtype), self.prelude_out.to(device, dtype), self.start_loop)

    def clone(self) -> Resume:
        return Resume(self.loop_state.clone(), self.prelude_out.clone(), self.start_loop)

    def copy_(self, other: Resume) -> None:
        """Into these tensors (a captured graph's inputs), `other`'s values, resumed at the same iteration."""
        assert other.start_loop == self.start_loop
        self.loop_state.copy_(other.loop_state)
        self.prelude_out.copy_(other.prelude_out)


class IterationView:
    """What a per-iteration hook sees after iteration `loop` (0-based): the loop state, the state before the
    iteration, the exit gate's logit (models with one), and `logits()`: the head's output if the loop stopped
    here (computed once, on demand; a forward that stops at this iteration returns it). Hooks need a backend
    whose ops leave their inputs alone (`TorchOps`)."""

    def __init__(self, ops: ForwardOps, w: ModelWeights, cfg: ArchConfig, loop: int, state: torch.Tensor,
                 previous: torch.Tensor, gate: torch.Tensor | None) -> None:  # fmt: skip
        self._ops, self._w, self._cfg = ops, w, cfg
        self.loop, self.state, self.previous, self.gate = loop, state, previous, gate
        self._logits: torch.Tensor | None = None

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = exit_logits(self._ops, self._w, self._cfg, self._ops.keep(self.state))
        return self._logits


# Called after each iteration: True stops the loop there (the coda and the head then read that state); a [B]
# bool tensor stops those batch rows (they keep their state while the others go on; all stopped ends the loop).
IterationHook = Callable[[IterationView], "bool | torch.Tensor"]


def layer(ops: ForwardOps, cfg: ArchConfig, x: torch.Tensor, lw: LayerWeights, slot: int) -> torch.Tensor:
    """One transformer layer with the config's norm placement: pre-norm residuals, or sandwich norms on
    each sublayer's output (added to the residual, or applied to the sum)."""
    if cfg.norm_placement == "pre":
        x = ops.attention(x, lw, slot, x)
    else:
        assert lw.attn_post_norm is not None
        x = ops.post_norm(ops.attention(x, lw, slot), lw.attn_post_norm, x, sum_first=_sum_first(cfg))
    if cfg.norm_placement == "pre":
        return ops.mlp(x, lw, x)  # x is this layer's own
    assert lw.mlp_post_norm is not None
    return ops.post_norm(ops.mlp(x, lw), lw.mlp_post_norm, x, sum_first=_sum_first(cfg))


def _sum_first(cfg: ArchConfig) -> bool:
    return cfg.norm_placement == "sandwich_sum"


def prelude(ops: ForwardOps, w: ModelWeights, cfg: ArchConfig, tokens: torch.Tensor) -> torch.Tensor:
    x = ops.embed(tokens, cfg.embed_scale)
    for i, lw in enumerate(w.prelude):
        x = layer(ops, cfg, x, lw, prelude_slot(cfg, i))
    return x


def start_state(ops: ForwardOps, cfg: ArchConfig, prelude_out: torch.Tensor) -> torch.Tensor:
    """The loop state before the first iteration (the prelude output may be overwritten: keep it first)."""
    if cfg.state_start == "prelude":
        return prelude_out
    if cfg.state_start == "zeros":
        return ops.zeros_state(prelude_out)
    return ops.noise_state(prelude_out)


def iterate(
    ops: ForwardOps, w: ModelWeights, cfg: ArchConfig, state: torch.Tensor, prelude_out: torch.Tensor, loop: int
) -> torch.Tensor:
    """One pass of the shared body (iteration index `loop`, 0-based); `w` already bound to the iteration
    (`at_iteration`) where its looped matrices are stochastic."""
    if cfg.injection == "add":
        x = ops.add(state, prelude_out)
    elif cfg.injection == "concat":
        assert w.adapter is not None
        x = ops.concat_project(state, prelude_out, w.adapter)
    else:
        x = state
    for j, lw in enumerate(w.body):
        x = layer(ops, cfg, x, lw, body_slot(cfg, loop, j))
    if cfg.loop_norm == "every_loop":
        assert w.final_norm is not None
        x = ops.norm(x, w.final_norm)
    return x


def coda(ops: ForwardOps, w: ModelWeights, cfg: ArchConfig, state: torch.Tensor) -> torch.Tensor:
    """The state leaving the loop through the loop's final norm and the coda (before the head's norm)."""
    x = state
    if cfg.loop_norm == "after_loop":
        assert w.final_norm is not None
        x = ops.norm(x, w.final_norm)
    for i, lw in enumerate(w.coda):
        x = layer(ops, cfg, x, lw, coda_slot(cfg, i))
    return x


def head_norm(w: ModelWeights, cfg: ArchConfig) -> Norm | None:
    if not cfg.head_norm:
        return None
    assert w.final_norm is not None
    return w.final_norm


def exit_logits(ops: ForwardOps, w: ModelWeights, cfg: ArchConfig, state: torch.Tensor) -> torch.Tensor:
    """The logits of a loop state: coda, head norm, head."""
    return ops.head(coda(ops, w, cfg, state), head_norm(w, cfg), cfg.logit_scale)


def run(
    ops: ForwardOps,
    w: ModelWeights,
    cfg: ArchConfig,
    tokens: torch.Tensor,
    loops: int,
    *,
    collect_states: bool = False,
    resume: Resume | None = None,
    on_iteration: IterationHook | None = None,
    depth: torch.Tensor | None = None,
) -> ForwardOutput:
    """The forward of tokens [B, T] at `loops` iterations over a backend; caches are the backend's.

    `resume` continues a forward that already ran resume.start_loop iterations on these positions: only the
    iterations after those, the coda and the head run. `on_iteration` sees each iteration's state and may stop
    the loop, or some rows, early (IterationHook). depth ([B], on the device): per-row iterations (<= loops); a
    row past its depth keeps its state through the remaining iterations, whose K/V it writes to slots it never
    reads.
    """
    states: list[torch.Tensor] | None = [] if collect_states else None
    start_loop = 0
    if resume is None:
        x = ops.embed(tokens, cfg.embed_scale)
        if states is not None:
            states.append(ops.keep(x))
        for i, lw in enumerate(w.prelude):
            x = layer(ops, cfg, x, lw, prelude_slot(cfg, i))
        p = ops.keep(x)
        if states is not None:
            states.append(p)
        s = start_state(ops, cfg, x)
    else:
        s, p = ops.resume(resume.loop_state, resume.prelude_out)
        start_loop = resume.start_loop
    gates: list[torch.Tensor] = []
    view: IterationView | None = None
    stochastic = has_cross_iter(w)  # cross-iteration rounding draws each iteration's own looped weights
    running: torch.Tensor | None = None  # rows a hook has not stopped
    for t in range(start_loop, loops):
        previous = s
        s = iterate(ops, at_iteration(w, t) if stochastic else w, cfg, s, p, t)
        live = depth > t if depth is not None else None
        if running is not None:
            live = running if live is None else live & running
        if live is not None:
            s = ops.where_rows(live, s, previous)
        if states is not None:
            states.append(ops.keep(s))
        gate = ops.gate(s) if w.exit_gate_weight is not None else None
        if gate is not None:
            gates.append(gate)
        if on_iteration is not None:
            view = IterationView(ops, w, cfg, t, s, previous, gate)
            stop = on_iteration(view)
            if isinstance(stop, torch.Tensor):
                running = ~stop if running is None else running & ~stop
                if not bool(running.any()):
                    break
            elif stop:
                break
    loop_state = ops.keep(s)
    if view is not None and view._logits is not None and view.state is s:
        logits = view._logits
    else:
        logits = exit_logits(ops, w, cfg, s)
    return ForwardOutput(
        logits=logits, states=states, gates=gates, loop_state=ops.rows(loop_state), prelude_out=ops.rows(p)
    )


def token_exit_forward(
    w: ModelWeights,
    cfg: ArchConfig,
    tokens: torch.Tensor,
    ctx: StepContext,
    iteration_ctx: Callable[[torch.Tensor], StepContext],
    loops: int,
    patience: int,
    *,
    dtype: torch.dtype,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scoring tokens [1, T] from position 0 where a position stops iterating after an iteration at which its
    argmax (the coda and head over `ctx`) has been the same for `patience` consecutive iterations.

    Only positions still iterating run the body, over iteration_ctx(their indices [n]), whose store must keep
    the K/V each exited position wrote last. Returns (logits [T, V], iterations each position ran [T]).
    """
    ops = TorchOps(w, cfg, ctx, dtype, noise)
    p = ops.keep(prelude(ops, w, cfg, tokens))
    s = start_state(ops, cfg, p).clone()
    T, dev = tokens.shape[1], tokens.device
    active = torch.ones(T, dtype=torch.bool, device=dev)
    exit_depth = torch.full((T,), loops, dtype=torch.long, device=dev)
    last_argmax = torch.full((T,), -1, dtype=torch.long, device=dev)
    streak = torch.zeros(T, dtype=torch.long, device=dev)
    for t in range(loops):
        idx = active.nonzero().squeeze(1)
        s[:, idx] = loop_iteration(w, cfg, s[:, idx], p[:, idx], iteration_ctx(idx), t)
        if t == loops - 1:
            break
        argmax = ops.head(coda(ops, w, cfg, s)[:, idx], head_norm(w, cfg), cfg.logit_scale)[0].argmax(-1)
        same = argmax == last_argmax[idx]
        streak[idx] = torch.where(same, streak[idx] + 1, torch.zeros_like(streak[idx]))
        last_argmax[idx] = argmax
        done = idx[streak[idx] >= patience]
        exit_depth[done] = t + 1
        active[done] = False
        if not bool(active.any()):
            break
    return exit_logits(ops, w, cfg, s)[0], exit_depth


# ---- the reference backend's entry points ----------------------------------------------------------------------
def forward(
    w: ModelWeights,
    cfg: ArchConfig,
    tokens: torch.Tensor,
    ctx: StepContext,
    loops: int,
    *,
    dtype: torch.dtype,
    noise: torch.Tensor | None = None,
    last_index: torch.Tensor | None = None,
    collect_states: bool = False,
    resume: Resume | None = None,
    on_iteration: IterationHook | None = None,
    depth: torch.Tensor | None = None,
) -> ForwardOutput:
    """`run` over torch ops (`TorchOps`); caches are read and written through ctx.

    The head only sees the positions named by `last_index` when it is given (decode); the coda still
    runs on every position, since later tokens attend to its K/V.
    """
    ops = TorchOps(w, cfg, ctx, dtype, noise, last_index)
    return run(ops, w, cfg, tokens, loops, collect_states=collect_states, resume=resume, on_iteration=on_iteration,
               depth=depth)  # fmt: skip


def embed(w: ModelWeights, cfg: ArchConfig, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return TorchOps(w, cfg, _NO_CONTEXT, dtype).embed(tokens, cfg.embed_scale)


def run_prelude(w: ModelWeights, cfg: ArchConfig, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    ops = TorchOps(w, cfg, ctx, x.dtype)
    for i, lw in enumerate(w.prelude):
        x = layer(ops, cfg, x, lw, prelude_slot(cfg, i))
    return x


def initial_state(
    cfg: ArchConfig, prelude_out: torch.Tensor, positions: torch.Tensor, noise: torch.Tensor | None
) -> torch.Tensor:
    """The loop state before the first iteration. `noise` is a [positions, d] table (random start)."""
    ctx = StepContext(positions, _EMPTY, _EMPTY, None, None)
    return start_state(TorchOps(_NO_WEIGHTS, cfg, ctx, prelude_out.dtype, noise), cfg, prelude_out)


def loop_iteration(
    w: ModelWeights, cfg: ArchConfig, state: torch.Tensor, prelude_out: torch.Tensor, ctx: StepContext, loop: int
) -> torch.Tensor:
    """One pass of the shared body (iteration index `loop`, 0-based), over torch ops."""
    w = at_iteration(w, loop)
    return iterate(TorchOps(w, cfg, ctx, state.dtype), w, cfg, state, prelude_out, loop)


def exit_hidden(w: ModelWeights, cfg: ArchConfig, state: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The state leaving the loop, through the coda and the final norm (before the head)."""
    x = coda(TorchOps(w, cfg, ctx, state.dtype), w, cfg, state)
    n = head_norm(w, cfg)
    return norm(x, n, cfg) if n is not None else x


def head(w: ModelWeights, cfg: ArchConfig, x: torch.Tensor) -> torch.Tensor:
    return TorchOps(w, cfg, _NO_CONTEXT, x.dtype).head(x, None, cfg.logit_scale)


NOISE_BLOCK_ROWS = 256


def state_noise_table(cfg: ArchConfig, positions: int, device: torch.device | str) -> torch.Tensor | None:
    """Seeded truncated-normal start states, one row per position, so a position's start never depends
    on how the sequence was split into steps. Rows come in blocks with their own seeds, so a table of
    any length holds the same rows as a longer one: the table is sized by the run, not by max_position."""
    if cfg.state_start != "random":
        return None
    std = cfg.state_init_std
    table = torch.empty(positions, cfg.d_model, dtype=torch.float32)
    for block, rows in enumerate(table.split(NOISE_BLOCK_ROWS)):
        gen = torch.Generator().manual_seed((cfg.state_init_seed ^ (block * 0x9E3779B97F4A7C15)) % 2**64)
        full = torch.empty(NOISE_BLOCK_ROWS, cfg.d_model, dtype=torch.float32)
        torch.nn.init.trunc_normal_(full, 0.0, std, -3 * std, 3 * std, generator=gen)
        rows.copy_(full[: len(rows)])
    return table.to(device)


_EMPTY = torch.empty(0)
_NO_CONTEXT = StepContext(_EMPTY, _EMPTY, _EMPTY, None, None)  # for ops that read no positions or cache
_NO_WEIGHTS: ModelWeights = None  # type: ignore[assignment]  # the state start reads no weights
