"""Per-loop views of one scoring pass: logit lens, trajectories, depth-to-depth KL, argmax stability.

Everything comes from a single forward: the loop states are collected on the way, and only the exit
path (coda, final norm, head) is re-applied to each intermediate state.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tinyloop.model.looped import exit_hidden, head
from tinyloop.runtime.engine import Engine


@dataclass
class Trajectory:
    """logits: [B, T, V] at full depth; states: embedding, prelude, then one [B, T, d] per loop."""

    logits: torch.Tensor
    states: list[torch.Tensor]


@torch.inference_mode()
def trajectory(engine: Engine, tokens: torch.Tensor, loops: int) -> Trajectory:
    """One forward of tokens [B, T] (equal-length sequences from position 0), keeping every loop state."""
    out = engine.step(tokens, None, loops, collect_states=True)
    assert out.logits is not None and out.states is not None
    return Trajectory(out.logits, out.states)


@torch.inference_mode()
def depth_logits(engine: Engine, traj: Trajectory, positions: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """For each depth 1..L, the float32 logits [B, T', V] the model gives if the loop stops there."""
    loops = len(traj.states) - 2
    B, T = traj.logits.shape[:2]
    ctx = engine.context(torch.arange(T, device=engine.device)[None].expand(B, T), None, None)
    for depth in range(1, loops + 1):
        if depth == loops:
            logits = traj.logits
        else:
            state = traj.states[1 + depth]
            logits = head(engine.weights, engine.cfg, exit_hidden(engine.weights, engine.cfg, state, ctx))
        yield logits if positions is None else logits[:, positions]


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats per row, computed in float64."""
    logp = torch.log_softmax(p_logits.double(), dim=-1)
    logq = torch.log_softmax(q_logits.double(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def stable_depth(argmax: torch.Tensor) -> torch.Tensor:
    """argmax [L, ...] -> [...]: the smallest depth (1-based) from which the argmax never changes again."""
    loops = argmax.shape[0]
    same_as_final = argmax == argmax[-1:]
    # Scan from the deepest depth down: a depth counts only if every deeper depth agrees too.
    suffix_ok = torch.flip(torch.cumprod(torch.flip(same_as_final, [0]).to(torch.int64), dim=0), [0]).bool()
    return loops - suffix_ok.sum(0) + 1
