"""Model methods that look inside the loop: logit lens, trajectory, uncertainty, consistency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tinyloop.runtime.engine import Engine
from tinyloop.runtime.introspect import depth_logits, kl_divergence, stable_depth, trajectory


@dataclass(frozen=True)
class UncertaintyScores:
    """logits [T, V]; kl [L-1, T]: kl[i] = KL(p_{i+2} || p_{i+1}) between the next-token distributions
    after iterations i+2 and i+1 (nats); per position: kl_final (the last pair), kl_max, and the entropy
    of the final distribution."""

    logits: np.ndarray
    kl: np.ndarray
    kl_final: np.ndarray
    kl_max: np.ndarray
    entropy: np.ndarray


@dataclass(frozen=True)
class ConsistencyScores:
    """logits [T, V]; argmax [L, T] per depth; consistent [T]: the argmax agreed over the last `window`
    depths (the gate); stable_depth [T]: the first depth (1-based) from which the argmax never changes."""

    logits: np.ndarray
    argmax: np.ndarray
    consistent: np.ndarray
    stable_depth: np.ndarray
    window: int


class IntrospectionMixin:
    """Needs `_engine`, `_check_open`, `_tokens` and `_loops` from the Model."""

    _engine: Engine

    def _check_open(self) -> None:
        raise NotImplementedError

    def _tokens(self, tokens: Any, name: str = "tokens") -> torch.Tensor:
        raise NotImplementedError

    def _loops(self, loops: int | None) -> int:
        raise NotImplementedError

    def score_logit_lens(
        self, tokens: Any, loops: int | None = None, positions: Any = None, top_k: int | None = None
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """float32 [L, T', V]: row i is the output if the loop stopped after iteration i+1.

        positions: optional indices to keep (T' of them); top_k: return (indices int32, values float32),
        each [L, T', k], instead of the full vocabulary.
        """
        self._check_open()
        ids = self._tokens(tokens)
        n_loops = self._loops(loops)
        pos = _positions(positions, int(ids.numel()))
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
            raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
        traj = trajectory(self._engine, ids, n_loops)
        rows = []
        for logits in depth_logits(self._engine, traj, pos):
            if top_k is None:
                rows.append(logits.float().cpu())
            else:
                k = min(top_k, logits.shape[-1])
                top = torch.topk(logits.float(), k, dim=-1)
                rows.append(torch.stack((top.indices.float(), top.values)).cpu())
        if top_k is None:
            return torch.stack(rows).numpy()
        stacked = torch.stack(rows, dim=1)  # [2, L, T', k]
        return stacked[0].to(torch.int32).numpy(), stacked[1].numpy()

    def score_trajectory(self, tokens: Any, loops: int | None = None) -> np.ndarray:
        """float32 [2 + L, T, d]: embedding output, prelude output, then the state after each iteration."""
        self._check_open()
        traj = trajectory(self._engine, self._tokens(tokens), self._loops(loops))
        return torch.stack(traj.states).float().cpu().numpy()

    def score_with_uncertainty(self, tokens: Any, loops: int | None = None) -> UncertaintyScores:
        """Final logits plus the KL divergence between consecutive depths at every position."""
        self._check_open()
        traj = trajectory(self._engine, self._tokens(tokens), self._loops(loops))
        kls = []
        previous = None
        for logits in depth_logits(self._engine, traj):
            if previous is not None:
                kls.append(kl_divergence(logits, previous))
            previous = logits
        T = traj.logits.shape[0]
        kl = torch.stack(kls) if kls else torch.zeros(0, T, dtype=torch.float64)
        logp = torch.log_softmax(traj.logits.double(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return UncertaintyScores(
            logits=traj.logits.float().cpu().numpy(),
            kl=kl.float().cpu().numpy(),
            kl_final=(kl[-1] if kls else torch.zeros(T)).float().cpu().numpy(),
            kl_max=(kl.max(0).values if kls else torch.zeros(T)).float().cpu().numpy(),
            entropy=entropy.float().cpu().numpy(),
        )

    def score_with_consistency(self, tokens: Any, loops: int | None = None, window: int = 3) -> ConsistencyScores:
        """Final logits plus, per position, whether the argmax agreed over the last `window` depths."""
        self._check_open()
        n_loops = self._loops(loops)
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= n_loops:
            raise ValueError(f"window must be an integer in [1, loops={n_loops}], got {window!r}")
        traj = trajectory(self._engine, self._tokens(tokens), n_loops)
        argmax = torch.stack([lg.argmax(-1) for lg in depth_logits(self._engine, traj)])
        consistent = (argmax[-window:] == argmax[-1:]).all(0)
        return ConsistencyScores(
            logits=traj.logits.float().cpu().numpy(),
            argmax=argmax.to(torch.int32).cpu().numpy(),
            consistent=consistent.cpu().numpy(),
            stable_depth=stable_depth(argmax).to(torch.int32).cpu().numpy(),
            window=window,
        )


def _positions(positions: Any, length: int) -> torch.Tensor | None:
    if positions is None:
        return None
    arr = np.asarray(positions)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError("positions must be a non-empty 1-D sequence of integers")
    if arr.min() < -length or arr.max() >= length:
        raise ValueError(f"positions must index a sequence of {length} tokens, got {arr.min()}..{arr.max()}")
    return torch.from_numpy(arr.astype(np.int64) % length)
