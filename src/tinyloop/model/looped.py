"""The looped forward pass: embedding -> prelude -> body x L (with injection) -> coda -> head."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinyloop.config import ArchConfig
from tinyloop.kernels.dispatch import embedding, linear
from tinyloop.model.cross_iter import at_iteration
from tinyloop.model.layers import StepContext, layer, norm
from tinyloop.model.slots import body_slot, coda_slot, prelude_slot
from tinyloop.model.weights import ModelWeights


@dataclass
class ForwardOutput:
    """logits: [B, T', V] float32 (T' = T, or 1 per row when only the last position was asked).

    states (when asked): embedding output, prelude output, then the loop state after each iteration
    (a resumed forward lists only the iterations it ran).
    gates (when the model has an exit gate): the gate's logit after each iteration run, [B, T].
    loop_state / prelude_out: the final loop state and the prelude output [B, T, d] (references, free),
    which is what a later forward needs to resume deeper (`resume=`).
    """

    logits: torch.Tensor | None
    states: list[torch.Tensor] | None = None
    gates: list[torch.Tensor] = field(default_factory=list)
    loop_state: torch.Tensor | None = None
    prelude_out: torch.Tensor | None = None


def embed(w: ModelWeights, cfg: ArchConfig, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = embedding(tokens, w.embed, dtype)
    return x * cfg.embed_scale if cfg.embed_scale != 1.0 else x


def run_prelude(w: ModelWeights, cfg: ArchConfig, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    for i, lw in enumerate(w.prelude):
        x = layer(x, lw, cfg, ctx, prelude_slot(cfg, i))
    return x


def initial_state(
    cfg: ArchConfig, prelude_out: torch.Tensor, positions: torch.Tensor, noise: torch.Tensor | None
) -> torch.Tensor:
    """The loop state before the first iteration. `noise` is a [positions, d] table (random start)."""
    if cfg.state_start == "prelude":
        return prelude_out
    if cfg.state_start == "zeros":
        return torch.zeros_like(prelude_out)
    assert noise is not None, "random state start needs the noise table"
    return noise[positions].to(prelude_out.dtype)


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


def loop_iteration(
    w: ModelWeights, cfg: ArchConfig, state: torch.Tensor, prelude_out: torch.Tensor, ctx: StepContext, loop: int
) -> torch.Tensor:
    """One pass of the shared body (iteration index `loop`, 0-based)."""
    w = at_iteration(w, loop)  # cross-iteration rounding draws each iteration's own looped weights
    if cfg.injection == "add":
        x = state + prelude_out
    elif cfg.injection == "concat":
        assert w.adapter is not None
        x = linear(torch.cat((state, prelude_out), dim=-1), w.adapter)
    else:
        x = state
    for j, lw in enumerate(w.body):
        x = layer(x, lw, cfg, ctx, body_slot(cfg, loop, j))
    if cfg.loop_norm == "every_loop":
        assert w.final_norm is not None
        x = norm(x, w.final_norm, cfg)
    return x


def gate_logit(w: ModelWeights, state: torch.Tensor) -> torch.Tensor:
    assert w.exit_gate_weight is not None and w.exit_gate_bias is not None
    g = state.float() @ w.exit_gate_weight.float().T + w.exit_gate_bias.float()
    return g.squeeze(-1)


def exit_hidden(w: ModelWeights, cfg: ArchConfig, state: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The state leaving the loop, through the coda and the final norm (before the head)."""
    x = state
    if cfg.loop_norm == "after_loop":
        assert w.final_norm is not None
        x = norm(x, w.final_norm, cfg)
    for i, lw in enumerate(w.coda):
        x = layer(x, lw, cfg, ctx, coda_slot(cfg, i))
    if cfg.head_norm:
        assert w.final_norm is not None
        x = norm(x, w.final_norm, cfg)
    return x


def head(w: ModelWeights, cfg: ArchConfig, x: torch.Tensor) -> torch.Tensor:
    logits = linear(x, w.head).float()
    return logits * cfg.logit_scale if cfg.logit_scale != 1.0 else logits


def select_rows(x: torch.Tensor, last_index: torch.Tensor | None) -> torch.Tensor:
    """Keep one position per row ([B, 1, d]) when `last_index` ([B]) is given."""
    if last_index is None:
        return x
    idx = last_index.view(-1, 1, 1).expand(-1, 1, x.shape[-1])
    return x.gather(1, idx)


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
    on_state: Callable[[int, torch.Tensor], None] | None = None,
    resume: tuple[torch.Tensor, torch.Tensor] | None = None,
    start_loop: int = 0,
    depth: torch.Tensor | None = None,
) -> ForwardOutput:
    """Full forward of tokens [B, T] at `loops` iterations; caches are read and written through ctx.

    The head only sees the positions named by `last_index` when it is given (decode); the coda still
    runs on every position, since later tokens attend to its K/V.
    resume=(loop_state, prelude_out) with start_loop=k continues a forward that already ran k
    iterations on these positions: only iterations k..loops-1, the coda and the head run.
    depth ([B], on the device): per-row iterations (<= loops); a row past its depth keeps its state
    through the remaining iterations, whose K/V it writes to slots it never reads.
    """
    states: list[torch.Tensor] | None = [] if collect_states else None
    if resume is None:
        if start_loop:
            raise ValueError("start_loop needs resume=(loop_state, prelude_out)")
        e = embed(w, cfg, tokens, dtype)
        p = run_prelude(w, cfg, e, ctx)
        if states is not None:
            states += [e, p]
        s = initial_state(cfg, p, ctx.positions, noise)
    else:
        s, p = resume
    gates: list[torch.Tensor] = []
    for t in range(start_loop, loops):
        nxt = loop_iteration(w, cfg, s, p, ctx, t)
        s = nxt if depth is None else torch.where((depth > t).view(-1, 1, 1), nxt, s)
        if states is not None:
            states.append(s)
        if w.exit_gate_weight is not None:
            gates.append(gate_logit(w, s))
        if on_state is not None:
            on_state(t, s)
    x = exit_hidden(w, cfg, s, ctx)
    logits = head(w, cfg, select_rows(x, last_index))
    return ForwardOutput(logits=logits, states=states, gates=gates, loop_state=s, prelude_out=p)
