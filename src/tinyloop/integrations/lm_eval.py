"""An lm-evaluation-harness backend ("tinyloop"): `import tinyloop.integrations.lm_eval` registers it.

    lm_eval.simple_evaluate(model="tinyloop", model_args="pretrained=tiny,loops=4", tasks=[...])

Scoring runs requests sorted by length in right-padded batches (a row's positions never see its padding).
A context shared by several continuations (a multiple-choice question) runs once per batch, and each
continuation continues from a copy of its KV cache (`Model.score_continuations`); a context asked once runs
whole with its continuation. Either way the tokens are lm-eval's: its context tokens, then its continuation's.
A depth sweep (`TinyLoopLM.sweep`) shares one scorer between one backend per depth: the first depth to
see a request scores it at every depth of the sweep from one forward, the others read the result.
A byte-level model reads text as UTF-8 bytes; a model with a tokenizer uses its embedded tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from tinyloop.api.arguments import checked_loops
from tinyloop.api.model import Model
from tinyloop.runtime.adaptive_exit import ExitCriterion

TASKS_DIR = Path(__file__).parent / "tasks"  # shipped local tasks (python_snippets)
NEWLINE = 10  # a byte-level model's document start: it has no bos/eos, and newlines separate its code
DEFAULT_MAX_GEN_TOKS = 256


@dataclass
class DepthTotals:
    """Exit depths read over every scored continuation token at one depth (for the mean exit depth)."""

    depth_sum: int = 0
    tokens: int = 0


# A log-likelihood request: the tokens of context + continuation, and the continuation's length.
Key = tuple[tuple[int, ...], int]


@dataclass
class Scorer:
    """The model and the depths it scores at once; results kept per (tokens, continuation length)."""

    model: Model
    depths: tuple[int, ...]
    batch_size: int
    exit_criterion: str | None = None
    exit_tol: float | None = None
    min_loops: int = 1
    results: dict[Key, dict[int, tuple[float, bool, int]]] = field(default_factory=dict)
    totals: dict[int, DepthTotals] = field(default_factory=dict)

    def score(self, rows: Sequence[tuple[list[int], int]], depth: int) -> list[tuple[float, bool]]:
        """(tokens, n) -> (sum of log p of the last n tokens, all of them greedy) at `depth`."""
        keys = [(tuple(tokens), n) for tokens, n in rows]
        by_context: dict[tuple[int, ...], list[Key]] = {}
        for key in sorted({k for k in keys if k not in self.results}, key=lambda k: (k[1], k[0])):
            by_context.setdefault(key[0][: -key[1]], []).append(key)
        # A context asked once gains nothing from a cache: its rows run whole, longest first.
        alone = sorted((ks[0] for ks in by_context.values() if len(ks) == 1), key=lambda k: (-len(k[0]), k))
        for start in range(0, len(alone), self.batch_size):
            self._score_whole(alone[start : start + self.batch_size])
        shared = [ks[i : i + self.batch_size] for ks in by_context.values() if len(ks) > 1
                  for i in range(0, len(ks), self.batch_size)]  # fmt: skip
        shared.sort(key=lambda ks: (-len(ks[-1][0]), ks[0][0]))
        for batch in self._context_batches(shared):
            self._score_shared(batch)
        totals = self.totals.setdefault(depth, DepthTotals())
        out = []
        for key in keys:
            lp, greedy, exit_sum = self.results[key][depth]
            totals.depth_sum += exit_sum
            totals.tokens += key[1]
            out.append((lp, greedy))
        return out

    def _context_batches(self, groups: list[list[Key]]) -> list[list[list[Key]]]:
        """Consecutive groups (one context each) up to batch_size continuations, within the positions a
        batch runs (its longest context plus its longest continuation)."""
        limit = self.model.max_seq_len + 1
        batches: list[list[list[Key]]] = []
        rows = context = continuation = 0
        for group in groups:
            m, n = len(group[0][0]) - group[0][1], max(k[1] for k in group)
            if batches and rows + len(group) <= self.batch_size and max(context, m) + max(continuation, n) <= limit:
                batches[-1].append(group)
                rows, context, continuation = rows + len(group), max(context, m), max(continuation, n)
            else:
                batches.append([group])
                rows, context, continuation = len(group), m, n
        return batches

    def _score_whole(self, batch: list[Key]) -> None:
        width = max(len(tokens) for tokens, _ in batch)
        ids = np.zeros((len(batch), width), dtype=np.int32)
        for i, (tokens, _) in enumerate(batch):
            ids[i, : len(tokens)] = tokens
        res = self.model.score_token_logprobs(
            ids, self.depths, exit_criterion=self.exit_criterion, exit_tol=self.exit_tol, min_loops=self.min_loops
        )
        for i, key in enumerate(batch):
            tokens, n = key
            span = slice(len(tokens) - 1 - n, len(tokens) - 1)  # positions predicting the last n tokens
            self._keep(key, res.depths, res.logprob[:, i, span], res.greedy[:, i, span], res.exit_depth[:, i, span])

    def _score_shared(self, batch: list[list[Key]]) -> None:
        groups = [(keys[0][0][: -keys[0][1]], [tokens[-n:] for tokens, n in keys]) for keys in batch]
        res = self.model.score_continuations(
            groups, self.depths, exit_criterion=self.exit_criterion, exit_tol=self.exit_tol, min_loops=self.min_loops
        )
        for keys, scores in zip(batch, res, strict=True):
            for key, r in zip(keys, scores, strict=True):
                self._keep(key, r.depths, r.logprob, r.greedy, r.exit_depth)

    def _keep(self, key: Key, depths: tuple[int, ...], lp: np.ndarray, greedy: np.ndarray, exits: np.ndarray) -> None:
        """A request's per-depth results from its continuation's rows [D, n]."""
        self.results[key] = {
            depth: (float(lp[d].sum()), bool(greedy[d].all()), int(exits[d].sum())) for d, depth in enumerate(depths)
        }


@register_model("tinyloop")
class TinyLoopLM(TemplateLM):
    """lm-eval model arguments: pretrained (a .tinyloop path or a built-in name), loops, kv_mode,
    exit_threshold (Ouro's exit CDF, the 'gate' criterion), exit_criterion / exit_tol / min_loops
    (per-position early exit), batch_size, device, dtype, max_length (tokens per request; None: the
    runtime's default for the model)."""

    def __init__(
        self,
        pretrained: str = "tiny",
        loops: int | None = None,
        kv_mode: str | None = None,
        exit_threshold: float | None = None,
        exit_criterion: str | None = None,
        exit_tol: float | None = None,
        min_loops: int = 1,
        batch_size: int | str = 16,
        max_batch_size: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_length: int | None = None,
        scorer: Scorer | None = None,
    ) -> None:
        super().__init__()
        del max_batch_size  # lm-eval passes it for its "auto" batch size, which this backend does not use
        if scorer is None:
            model = Model(pretrained, max_seq_len=max_length, device=device, dtype=dtype, kv_mode=kv_mode)
            depth = checked_loops(loops, model.header.config)
            criterion, tol = _exit_rule(exit_threshold, exit_criterion, exit_tol)
            if criterion is not None:
                ExitCriterion(criterion, tol, min_loops)  # refuse a bad rule before any request runs
            if criterion == "gate" and not model.header.config.exit_gate:
                raise ValueError("exit_threshold (the 'gate' criterion) needs a model with an exit gate (Ouro)")
            scorer = Scorer(model, (depth,), _batch_size(batch_size), criterion, tol, min_loops)
        else:
            depth = checked_loops(loops, scorer.model.header.config)
        self.scorer = scorer
        self.model = scorer.model
        self.loops = depth
        self.max_length = self.model.max_seq_len
        self.byte_level = not self.model.has_tokenizer
        self.generated_exit_depths: list[int] = []

    @classmethod
    def sweep(cls, depths: Sequence[int] | None, pretrained: str = "tiny", **kwargs: Any) -> list[TinyLoopLM]:
        """One backend per depth (None: the model's default), sharing one model and one scorer (every
        depth from one forward)."""
        first = cls(pretrained, loops=max(depths) if depths else None, **kwargs)
        scorer = first.scorer
        cfg = scorer.model.header.config
        scorer.depths = tuple(sorted({checked_loops(d, cfg) for d in depths})) if depths else (first.loops,)
        return [first if d == first.loops else cls(loops=d, scorer=scorer) for d in scorer.depths]

    @property
    def mean_exit_depth(self) -> float:
        """Mean depth read per scored token (and per generated token), NaN when nothing was run."""
        totals = self.scorer.totals.get(self.loops, DepthTotals())
        depth_sum = totals.depth_sum + sum(self.generated_exit_depths)
        count = totals.tokens + len(self.generated_exit_depths)
        return depth_sum / count if count else float("nan")

    # ---- tokenization ------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        if self.byte_level:
            return NEWLINE
        stops = self.model.tokenizer.stop_ids
        return stops[0] if stops else self.prefix_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.byte_level:
            return NEWLINE
        meta = self.model.tokenizer.meta
        if meta.bos_id is not None:
            return int(meta.bos_id)
        if meta.stop_ids:
            return int(meta.stop_ids[0])
        raise ValueError("the model's tokenizer has neither a bos nor an eos token to start a document with")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return [int(t) for t in self.model.encode(string, add_bos=False)]

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.model.decode(np.asarray(tokens, dtype=np.int32)) if len(tokens) else ""

    @property
    def tokenizer_name(self) -> str:
        return "bytes" if self.byte_level else f"tinyloop:{self.model.path.name}"

    # ---- scoring -------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval asked for the log-likelihood of an empty continuation")
            if len(continuation) >= self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens does not fit max_length {self.max_length}"
                )
            tokens = (context + continuation)[-self.max_length :]
            rows.append((tokens, len(continuation)))
        results = self.scorer.score(rows, self.loops)
        for (cache_key, _, _), result in zip(requests, results, strict=True):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[Any, list[int], list[int]]] = []
        counts = []
        for request in requests:
            (text,) = request.args
            pieces = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            doc = [lm_utils.make_disjoint_window(p) for p in pieces]
            windows.extend((None, context, continuation) for context, continuation in doc)
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows)
        out = []
        start = 0
        for request, count in zip(requests, counts, strict=True):
            total = sum(lp for lp, _ in scores[start : start + count])
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            out.append(total)
        return out

    # ---- generation --------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if a request asks) continuations up to the first `until` string, rows of
        similar length decoded together by Model.generate_batch (per-position exit rules: one at a time)."""
        jobs = [self._generation_job(*request.args) for request in requests]
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i].prompt))
        size = 1 if self.scorer.exit_criterion is not None else self.scorer.batch_size
        out: list[str] = [""] * len(jobs)
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for i, tokens in zip(chunk, self._generate([jobs[i] for i in chunk]), strict=True):
                text = self.tok_decode(tokens.tolist())
                for stop in jobs[i].until:  # generate keeps a token that straddles a stop string: cut there
                    text = text.split(stop)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generation_job(self, context: str, gen_kwargs: dict[str, Any] | None) -> _Generation:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else [u for u in until if u]
        max_gen = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
        if not 0 < max_gen < self.max_length:
            raise ValueError(f"max_gen_toks must be in [1, max_length {self.max_length}), got {max_gen}")
        prompt = self.tok_encode(context)[-(self.max_length - max_gen) :] or [self.prefix_token_id]
        return _Generation(np.asarray(prompt, dtype=np.int32), until, max_gen, temperature)

    def _generate(self, jobs: list[_Generation]) -> list[np.ndarray]:
        model, scorer = self.model, self.scorer
        stop_ids = [] if self.byte_level else list(model.tokenizer.stop_ids)
        if scorer.exit_criterion is None:
            return model.generate_batch(
                [j.prompt for j in jobs], [j.max_tokens for j in jobs], self.loops,
                temperature=[j.temperature for j in jobs], stop=[j.until or None for j in jobs],
                stop_tokens=stop_ids or None,
            )  # fmt: skip
        (job,) = jobs
        tokens = model.generate_tokens(
            job.prompt, job.max_tokens, self.loops, temperature=job.temperature,
            exit_criterion=scorer.exit_criterion, exit_tol=scorer.exit_tol, min_loops=scorer.min_loops,
        )  # fmt: skip
        if model.last_family_stats is not None:
            self.generated_exit_depths.extend(model.last_family_stats.exit_depths)
        cut = next((k for k, t in enumerate(tokens) if int(t) in stop_ids), len(tokens))
        return [tokens[:cut]]


@dataclass(frozen=True)
class _Generation:
    """One generate_until request, tokenized: the prompt (left-truncated to leave room) and its limits."""

    prompt: np.ndarray
    until: list[str]
    max_tokens: int
    temperature: float


def task_manager(include_path: str | Path | None = None, include_defaults: bool = False) -> Any:
    """lm-eval's TaskManager over the shipped local tasks and those under include_path; include_defaults
    adds lm-eval's own tasks (indexing them takes seconds, and most need a download or a filled cache)."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + ([str(include_path)] if include_path is not None else [])
    return TaskManager(include_path=paths, include_defaults=include_defaults)


def _batch_size(value: int | str) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or isinstance(value, bool):
        raise ValueError(f"batch_size must be a positive integer, got {value!r}")
    return size


def _exit_rule(threshold: float | None, criterion: str | None, tol: float | None) -> tuple[str | None, float | None]:
    if threshold is None:
        return criterion, tol
    if criterion is not None:
        raise ValueError("choose exit_threshold or exit_criterion, not both")
    return "gate", float(threshold)
