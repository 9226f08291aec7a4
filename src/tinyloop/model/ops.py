"""The operations the looped forward (model/looped.py) is written in, and the reference backend.

The forward decides what runs: the stages, the injection, where the norms sit, the state start, the exit
gate. A backend (`ForwardOps`) decides how, for the rows of one step: `TorchOps` here with plain torch
ops through the kernel dispatch point (the reference, and every step no fast path takes), the CPU decode
step (runtime/cpu_decode.py: preallocated buffers, in-place residuals) and the CUDA kernels
(runtime/fused_decode.py: fused launches, captured in CUDA graphs, where Python costs nothing at replay).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tinyloop.config import ArchConfig
from tinyloop.kernels.dispatch import Weight, embedding, linear
from tinyloop.model.layers import StepContext, attend, norm
from tinyloop.model.weights import LayerWeights, ModelWeights, Norm


class ForwardOps(Protocol):
    """A backend's operations over its row tensors (any layout it likes, e.g. [B, T, d] or [B * T, d]).

    An op may overwrite an input the forward does not use again: `residual` of `project` and `post_norm`,
    the input of `norm`, `zeros_state` and `noise_state`. The forward calls `keep` on what it reads later.
    """

    def embed(self, tokens: torch.Tensor, scale: float) -> torch.Tensor:
        """Embedding rows of tokens [B, T], times `scale`."""
        ...

    def attention(
        self, x: torch.Tensor, lw: LayerWeights, slot: int, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The attention sublayer: norm(x) (lw.attn_norm) -> QKV (+ q/k bias) -> RoPE -> this step's K/V into
        cache slot `slot` -> attention over the cache -> the output projection lw.out (+ residual, as `project`)."""
        ...

    def project(
        self, h: torch.Tensor, w: Weight, residual: torch.Tensor | None = None, *, into_residual: bool = False
    ) -> torch.Tensor:
        """h @ w.T (+ residual). into_residual: the residual's storage may take the result."""
        ...

    def post_norm(self, y: torch.Tensor, n: Norm, residual: torch.Tensor, *, sum_first: bool) -> torch.Tensor:
        """residual + norm(y), or norm(y + residual) when `sum_first`."""
        ...

    def mlp(self, x: torch.Tensor, lw: LayerWeights, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP sublayer: norm(x) (lw.mlp_norm) through gate/up and SwiGLU (or up and GELU), then the down
        projection (+ residual, whose storage may take the result)."""
        ...

    def norm(self, x: torch.Tensor, n: Norm) -> torch.Tensor: ...

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...

    def concat_project(self, state: torch.Tensor, prelude_out: torch.Tensor, adapter: Weight) -> torch.Tensor:
        """cat(state, prelude_out) @ adapter.T."""
        ...

    def zeros_state(self, like: torch.Tensor) -> torch.Tensor: ...

    def noise_state(self, like: torch.Tensor) -> torch.Tensor:
        """The seeded start state of each row's position (model/looped.py state_noise_table)."""
        ...

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """x as a value later ops leave alone (a copy where ops work in place)."""
        ...

    def gate(self, state: torch.Tensor) -> torch.Tensor:
        """The exit gate's logit per position, [B, T] float32."""
        ...

    def head(self, x: torch.Tensor, n: Norm | None, scale: float) -> torch.Tensor:
        """Logits [B, T', V] float32 (T' = 1 where the step asked for the last positions only) of norm(x)
        (when `n`) times `scale`."""
        ...

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as [B, T, d] (what ForwardOutput holds)."""
        ...

    def where_rows(self, take_new: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """Per batch row (take_new [B] bool): the row of `new`, else of `old`."""
        ...

    def resume(self, state: torch.Tensor, prelude_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A resumed forward's ([B, T, d]) loop state and prelude output in the backend's layout."""
        ...


class TorchOps:
    """The reference backend: [B, T, d] tensors, torch ops, matrices through kernels/dispatch.py, the cache
    through `ctx` (any KV store). `last_index` ([B]): the head sees only these positions (decode)."""

    def __init__(
        self,
        w: ModelWeights,
        cfg: ArchConfig,
        ctx: StepContext,
        dtype: torch.dtype,
        noise: torch.Tensor | None = None,
        last_index: torch.Tensor | None = None,
    ) -> None:
        self.w, self.cfg, self.ctx, self.dtype = w, cfg, ctx, dtype
        self.noise = noise
        self.last_index = last_index

    def embed(self, tokens: torch.Tensor, scale: float) -> torch.Tensor:
        x = embedding(tokens, self.w.embed, self.dtype)
        return x * scale if scale != 1.0 else x

    def attention(
        self, x: torch.Tensor, lw: LayerWeights, slot: int, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.project(attend(norm(x, lw.attn_norm, self.cfg), lw, self.cfg, self.ctx, slot), lw.out, residual)

    def project(
        self, h: torch.Tensor, w: Weight, residual: torch.Tensor | None = None, *, into_residual: bool = False
    ) -> torch.Tensor:
        y = linear(h, w)
        return y if residual is None else residual + y

    def post_norm(self, y: torch.Tensor, n: Norm, residual: torch.Tensor, *, sum_first: bool) -> torch.Tensor:
        if sum_first:
            return norm(y + residual, n, self.cfg)
        return residual + norm(y, n, self.cfg)

    def mlp(self, x: torch.Tensor, lw: LayerWeights, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.project(self.mlp_in(x, lw), lw.down, residual, into_residual=residual is not None)

    def mlp_in(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        h = norm(x, lw.mlp_norm, self.cfg)
        if lw.gate_up is not None:
            gate, up = linear(h, lw.gate_up).chunk(2, dim=-1)
            return F.silu(gate) * up
        assert lw.up is not None
        return F.gelu(linear(h, lw.up))

    def norm(self, x: torch.Tensor, n: Norm) -> torch.Tensor:
        return norm(x, n, self.cfg)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def concat_project(self, state: torch.Tensor, prelude_out: torch.Tensor, adapter: Weight) -> torch.Tensor:
        return linear(torch.cat((state, prelude_out), dim=-1), adapter)

    def zeros_state(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like)

    def noise_state(self, like: torch.Tensor) -> torch.Tensor:
        assert self.noise is not None, "random state start needs the noise table"
        return self.noise[self.ctx.positions].to(like.dtype)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gate(self, state: torch.Tensor) -> torch.Tensor:
        return gate_logit(self.w, state)

    def head(self, x: torch.Tensor, n: Norm | None, scale: float) -> torch.Tensor:
        if n is not None:
            x = norm(x, n, self.cfg)
        if self.last_index is not None:
            idx = self.last_index.view(-1, 1, 1).expand(-1, 1, x.shape[-1])
            x = x.gather(1, idx)  # [B, 1, d]
        logits = linear(x, self.w.head).float()
        return logits * scale if scale != 1.0 else logits

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def where_rows(self, take_new: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return torch.where(take_new.view(-1, 1, 1), new, old)

    def resume(self, state: torch.Tensor, prelude_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return state, prelude_out


def gate_logit(w: ModelWeights, state: torch.Tensor) -> torch.Tensor:
    """The exit gate's logit of each state row, in float32 (the last dimension dropped)."""
    assert w.exit_gate_weight is not None and w.exit_gate_bias is not None
    g = state.float() @ w.exit_gate_weight.float().T + w.exit_gate_bias.float()
    return g.squeeze(-1)
