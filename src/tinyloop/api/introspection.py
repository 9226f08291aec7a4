"""Model methods that look inside the loop: logit lens, trajectory, uncertainty, consistency."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tinyloop.api.base import ModelBase
from tinyloop.cache.memory import check_host_memory
from tinyloop.runtime.adaptive_exit import ExitCriterion
from tinyloop.runtime.depth_scores import continuation_logprobs, depth_logprobs
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


@dataclass(frozen=True)
class TokenLogprobs:
    """depths: the depths scored (ascending); per depth and position t < T-1: logprob float64 [D, T-1]
    (log p(tokens[t+1] | tokens[..t])), greedy bool [D, T-1] (tokens[t+1] is the argmax), exit_depth
    int32 [D, T-1] (the depth whose logits were read); a [B, T] batch adds an axis after D."""

    depths: tuple[int, ...]
    logprob: np.ndarray
    greedy: np.ndarray
    exit_depth: np.ndarray


class IntrospectionMixin(ModelBase):
    """Scoring that looks inside the loop."""

    def _batch(self, tokens: Any) -> tuple[torch.Tensor, bool]:
        """tokens as [B, T]: a 1-D input is one sequence (results without a batch axis); a 2-D input
        [B, T] is B sequences of equal length (results with a leading batch axis)."""
        arr = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else tokens
        if isinstance(arr, (list, tuple)) and arr and isinstance(arr[0], (list, tuple, np.ndarray)):
            arr = [np.asarray(row) for row in arr]
            if len({row.shape for row in arr}) != 1:
                raise ValueError("a batch of token sequences must have equal lengths (pad or split it)")
            arr = np.stack(arr)
        if isinstance(arr, np.ndarray) and arr.ndim == 2:
            if arr.shape[0] == 0:
                raise ValueError("a batch of token sequences must not be empty")
            rows = [self._tokens(row, f"tokens[{i}]") for i, row in enumerate(arr)]
            return torch.stack(rows), True
        return self._tokens(arr)[None], False

    def score_logit_lens(
        self, tokens: Any, loops: int | None = None, positions: Any = None, top_k: int | None = None
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """float32 [L, T', V]: row i is the output if the loop stopped after iteration i+1 ([B, L, T', V]
        for a [B, T] batch).

        positions: optional indices to keep (T' of them); top_k: return (indices int32, values float32),
        each [L, T', k], instead of the full vocabulary.
        """
        self._check_open()
        ids, batched = self._batch(tokens)
        n_loops = self._loops(loops)
        pos = _positions(positions, int(ids.shape[1]))
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
            raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
        _check_memory(self._engine, ids, n_loops, full_lens=top_k is None)
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
            lens = torch.stack(rows, dim=1)  # [B, L, T', V]
            return _unbatch(lens, batched).numpy()
        stacked = torch.stack(rows, dim=2)  # [2, B, L, T', k]
        return _unbatch(stacked[0], batched).to(torch.int32).numpy(), _unbatch(stacked[1], batched).numpy()

    def score_token_logprobs(
        self,
        tokens: Any,
        loops: int | Sequence[int] | None = None,
        *,
        exit_criterion: str | None = None,
        exit_tol: float | None = None,
        min_loops: int = 1,
    ) -> TokenLogprobs:
        """Log-probabilities of each next token of `tokens` (1-D, or [B, T] rows; right-padding a row
        leaves its earlier positions unchanged) at the depth `loops`, or at every depth of a sequence
        such as (1, 2, 4, 8) from one forward at the deepest (equal to separate runs at each depth).

        exit_criterion ('kl', 'entropy', 'argmax', 'latent', 'gate'; exit_tol, min_loops as in
        generate_tokens_stream): every loop runs and each position reads the first depth whose check
        fires (at most the asked depth); exit_depth says which.
        """
        self._check_open()
        ids, batched = self._batch(tokens)
        if ids.shape[1] < 2:
            raise ValueError("scoring next tokens needs at least 2 tokens per row")
        depths = self._depths(loops)
        crit = None if exit_criterion is None else ExitCriterion(exit_criterion, exit_tol, min_loops)
        _check_memory(self._engine, ids, depths[-1])
        res = depth_logprobs(self._engine, ids, depths, crit)

        def out(t: torch.Tensor, dtype: Any) -> np.ndarray:
            return (t if batched else t[:, 0]).cpu().numpy().astype(dtype, copy=False)

        return TokenLogprobs(
            depths, out(res.logprob, np.float64), out(res.greedy, np.bool_), out(res.exit_depth, np.int32)
        )

    def score_continuations(
        self,
        groups: Sequence[tuple[Any, Sequence[Any]]],
        loops: int | Sequence[int] | None = None,
        *,
        exit_criterion: str | None = None,
        exit_tol: float | None = None,
        min_loops: int = 1,
    ) -> list[list[TokenLogprobs]]:
        """For each (context, continuations) group, the log-probabilities of each continuation's tokens
        after the context: out[g][j].logprob [D, n] (n: that continuation's length), entry t =
        log p(continuation[t] | context + continuation[:t]); greedy and exit_depth alike (loops and the
        exit rule as in `score_token_logprobs`). Each context runs once, in one batch with the others, and
        its continuations continue from copies of its KV cache: the values equal `score_token_logprobs`
        of context + continuation at those positions, up to float rounding (attention over a cache)."""
        self._check_open()
        depths = self._depths(loops)
        crit = None if exit_criterion is None else ExitCriterion(exit_criterion, exit_tol, min_loops)
        if not groups:
            raise ValueError("groups must be a non-empty sequence of (context, continuations) pairs")
        contexts, continuations, owner = [], [], []
        for g, group in enumerate(groups):
            if not isinstance(group, (tuple, list)) or len(group) != 2:
                raise ValueError(f"groups[{g}] must be a (context, continuations) pair")
            context = self._tokens(group[0], f"groups[{g}] context")
            if not len(group[1]):
                raise ValueError(f"groups[{g}] has no continuations")
            for j, tokens in enumerate(group[1]):
                continuations.append(self._tokens(tokens, f"groups[{g}] continuation {j}"))  # refuses no tokens
                owner.append(g)
            contexts.append(context)
        span = max(map(len, contexts)) + max(map(len, continuations)) - 1
        if span > self.max_seq_len:
            raise ValueError(f"the longest context and the longest continuation need {span} positions, more "
                             f"than max_seq_len {self.max_seq_len}: score the longest groups apart")  # fmt: skip
        cfg = self.header.config
        per_position = (depths[-1] + 2) * cfg.d_model + 2 * cfg.n_cache_slots(depths[-1]) * cfg.kv_dim  # states, K/V
        check_host_memory(torch.device("cpu"), per_position * (len(contexts) + len(continuations)) * span * 4)
        res = continuation_logprobs(self._engine, contexts, continuations, torch.tensor(owner), depths, crit)
        out: list[list[TokenLogprobs]] = [[] for _ in contexts]
        for r, (g, continuation) in enumerate(zip(owner, continuations, strict=True)):
            n = len(continuation)

            def row(t: torch.Tensor, dtype: Any, r: int = r, n: int = n) -> np.ndarray:
                return t[:, r, :n].cpu().numpy().astype(dtype, copy=False)

            lp, greedy, exit_depth = (
                row(res.logprob, np.float64),
                row(res.greedy, np.bool_),
                row(res.exit_depth, np.int32),
            )
            out[g].append(TokenLogprobs(depths, lp, greedy, exit_depth))
        return out

    def _depths(self, loops: int | Sequence[int] | None) -> tuple[int, ...]:
        """One depth, or the distinct depths of a sequence in ascending order."""
        if loops is None or not isinstance(loops, Sequence):
            return (self._loops(loops),)
        depths = tuple(sorted({self._loops(d) for d in loops}))
        if not depths:
            raise ValueError("loops must be an integer or a non-empty sequence of integers")
        return depths

    def score_trajectory(self, tokens: Any, loops: int | None = None) -> np.ndarray:
        """float32 [2 + L, T, d]: embedding output, prelude output, then the state after each iteration
        ([B, 2 + L, T, d] for a [B, T] batch)."""
        self._check_open()
        ids, batched = self._batch(tokens)
        n_loops = self._loops(loops)
        _check_memory(self._engine, ids, n_loops)
        traj = trajectory(self._engine, ids, n_loops)
        return _unbatch(torch.stack(traj.states, dim=1), batched).float().cpu().numpy()

    def score_with_uncertainty(self, tokens: Any, loops: int | None = None) -> UncertaintyScores:
        """Final logits plus the KL divergence between consecutive depths at every position (each field
        gains a leading batch axis for a [B, T] batch)."""
        self._check_open()
        ids, batched = self._batch(tokens)
        n_loops = self._loops(loops)
        _check_memory(self._engine, ids, n_loops)
        traj = trajectory(self._engine, ids, n_loops)
        kls = []
        previous = None
        for logits in depth_logits(self._engine, traj):
            if previous is not None:
                kls.append(kl_divergence(logits, previous))
            previous = logits
        B, T = ids.shape
        kl = torch.stack(kls, dim=1) if kls else torch.zeros(B, 0, T, dtype=torch.float64)  # [B, L-1, T]
        logp = torch.log_softmax(traj.logits.double(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)

        def out(t: torch.Tensor) -> np.ndarray:
            return _unbatch(t, batched).float().cpu().numpy()

        return UncertaintyScores(
            logits=out(traj.logits),
            kl=out(kl),
            kl_final=out(kl[:, -1] if kls else torch.zeros(B, T)),
            kl_max=out(kl.max(1).values if kls else torch.zeros(B, T)),
            entropy=out(entropy),
        )

    def score_with_consistency(self, tokens: Any, loops: int | None = None, window: int = 3) -> ConsistencyScores:
        """Final logits plus, per position, whether the argmax agreed over the last `window` depths (each
        field gains a leading batch axis for a [B, T] batch)."""
        self._check_open()
        n_loops = self._loops(loops)
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= n_loops:
            raise ValueError(f"window must be an integer in [1, loops={n_loops}], got {window!r}")
        ids, batched = self._batch(tokens)
        _check_memory(self._engine, ids, n_loops)
        traj = trajectory(self._engine, ids, n_loops)
        argmax = torch.stack([lg.argmax(-1) for lg in depth_logits(self._engine, traj)])  # [L, B, T]
        consistent = (argmax[-window:] == argmax[-1:]).all(0)
        return ConsistencyScores(
            logits=_unbatch(traj.logits, batched).float().cpu().numpy(),
            argmax=_unbatch(argmax.transpose(0, 1), batched).to(torch.int32).cpu().numpy(),
            consistent=_unbatch(consistent, batched).cpu().numpy(),
            stable_depth=_unbatch(stable_depth(argmax), batched).to(torch.int32).cpu().numpy(),
            window=window,
        )


def _unbatch(t: torch.Tensor, batched: bool) -> torch.Tensor:
    return t if batched else t[0]


def _positions(positions: Any, length: int) -> torch.Tensor | None:
    if positions is None:
        return None
    arr = np.asarray(positions)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError("positions must be a non-empty 1-D sequence of integers")
    if arr.min() < -length or arr.max() >= length:
        raise ValueError(f"positions must index a sequence of {length} tokens, got {arr.min()}..{arr.max()}")
    return torch.from_numpy(arr.astype(np.int64) % length)


def _check_memory(engine: Any, ids: torch.Tensor, loops: int, full_lens: bool = False) -> None:
    """Refuse before running when the states of every iteration (and, for a full logit lens, its
    [B, L, T, V] float32 result, built twice) cannot fit in host memory."""
    batch, length = ids.shape
    cfg = engine.cfg
    nbytes = (loops + 2) * batch * length * cfg.d_model * 4
    if full_lens:
        nbytes += 2 * loops * batch * length * cfg.vocab_size * 4
    check_host_memory(torch.device("cpu"), nbytes)
