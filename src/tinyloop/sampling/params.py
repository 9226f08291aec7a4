"""`SamplingParams`: everything one generation request asks for, checked once, in one place.

Every public generate/stream method builds one of these from its arguments (numpy scalars accepted,
bools refused, each error naming its argument); the runtime only reads them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from tinyloop.errors import ArgumentTypeError

# torch.Generator.manual_seed takes any value in [0, 2**64).
SEED_LIMIT = 1 << 64
# Most alternatives a request may ask per token (the OpenAI API's limit on top_logprobs).
MAX_TOP_LOGPROBS = 20
EXIT_CRITERIA = ("kl", "entropy", "argmax", "latent", "gate")


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _int(name: str, value: Any, low: int, what: str = "") -> int:
    if _is_bool(value) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an integer >= {low}{what}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}{what}, got {value!r}")
    return int(value)


def _optional_int(name: str, value: Any, low: int) -> int | None:
    return None if value is None else _int(name, value, low, " or None")


def _number(name: str, value: Any) -> float:
    if _is_bool(value) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _temperature(value: Any) -> float:
    t = _number("temperature", value)
    # Below the smallest normal float, logits / temperature overflows to inf (and sampling to NaN).
    if t != 0.0 and not t >= sys.float_info.min:
        raise ValueError(f"temperature must be 0 (greedy) or a positive normal float (>= {sys.float_info.min}), "
                         f"got {value!r}")  # fmt: skip
    return t


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if _is_bool(value) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"seed must be an integer in [0, 2**64) or None, got {value!r}")
    if not 0 <= value < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {value!r}")
    return int(value)


def _stop_strings(value: Any) -> tuple[bytes, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        value = [value]
    elif not isinstance(value, Iterable) or isinstance(value, dict):
        raise ArgumentTypeError(f"stop must be a str, bytes or a list of them, got {value!r}")
    out = []
    for s in value:
        if not isinstance(s, (str, bytes)):
            raise ArgumentTypeError(f"stop must be non-empty strings (or bytes), got {s!r}")
        if not s:
            raise ValueError(f"stop must be non-empty strings (or bytes), got {s!r}")
        out.append(s.encode("utf-8") if isinstance(s, str) else bytes(s))
    return tuple(out)


def _stop_tokens(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, (int, np.integer)) and not _is_bool(value):
        value = [value]
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ArgumentTypeError(f"stop_tokens must be a token id or a list of token ids, got {value!r}")
    ids = list(value)
    for t in ids:
        if _is_bool(t) or not isinstance(t, (int, np.integer)):
            raise ArgumentTypeError(f"stop_tokens must be token ids (integers >= 0), got {t!r}")
        if t < 0:
            raise ValueError(f"stop_tokens must be token ids (integers >= 0), got {t!r}")
    return frozenset(int(t) for t in ids)


def _grammar(value: Any) -> Any:
    from tinyloop.grammar.grammar import Grammar

    if value is None or isinstance(value, Grammar):
        return value
    if isinstance(value, str):
        return Grammar(value)
    raise ArgumentTypeError(f"grammar must be a tinyloop.Grammar or a regex str, got {type(value).__name__}")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What one request asks for; construction validates and normalises every field.

    max_tokens: new tokens at most. loops: loop iterations (None: the model's default). temperature 0 is
    greedy; top_k 0 and top_p 1 disable those filters; seed makes sampling repeat. stop: strings (bytes)
    that end generation; stop_tokens: ids that end it (neither is returned). grammar: a tinyloop.Grammar
    (a regex str is compiled into one). l_warmup_tokens / l_warmup_loops: the depth schedule (the first N
    decode steps at M loops). exit_*: the families' exit policy (Ouro's rules: exit_threshold,
    exit_at_step, weighted_exit; per-token adaptive depth: exit_criterion, exit_tol, min_loops).
    logprobs: record each generated token's log-probability and its `logprobs` most likely alternatives
    (0 to 20; None records nothing) in the request's stats.
    """

    max_tokens: int = 128
    loops: int | None = None
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[bytes, ...] = ()
    stop_tokens: frozenset[int] = field(default_factory=frozenset)
    grammar: Any = None
    l_warmup_tokens: int = 0
    l_warmup_loops: int = 2
    exit_threshold: float | None = None
    exit_at_step: int | None = None
    weighted_exit: bool = False
    exit_criterion: str | None = None
    exit_tol: float | None = None
    min_loops: int = 1
    logprobs: int | None = None

    def __post_init__(self) -> None:
        top_p = _number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.exit_threshold is not None:
            threshold = _number("exit_threshold", self.exit_threshold)
            if not 0.0 <= threshold <= 1.0:
                raise ValueError(f"exit_threshold must be in [0, 1], got {self.exit_threshold!r}")
        if not _is_bool(self.weighted_exit):
            raise ArgumentTypeError(f"weighted_exit must be True or False, got {self.weighted_exit!r}")
        if self.exit_criterion is not None and self.exit_criterion not in EXIT_CRITERIA:
            raise ValueError(f"exit criterion must be one of {list(EXIT_CRITERIA)} (exit_criterion), "
                             f"got {self.exit_criterion!r}")  # fmt: skip
        if self.exit_tol is not None and self.exit_criterion is None:
            raise ValueError("exit_tol needs exit_criterion")
        normal = {
            "max_tokens": _int("max_tokens", self.max_tokens, 0),
            "loops": _optional_int("loops", self.loops, 1),
            "temperature": _temperature(self.temperature),
            "top_k": _int("top_k", self.top_k, 0, " (0 disables it)"),
            "top_p": top_p,
            "seed": _seed(self.seed),
            "stop": _stop_strings(self.stop),
            "stop_tokens": _stop_tokens(self.stop_tokens),
            "grammar": _grammar(self.grammar),
            "l_warmup_tokens": _int("l_warmup_tokens", self.l_warmup_tokens, 0),
            "l_warmup_loops": _int("l_warmup_loops", self.l_warmup_loops, 1),
            "exit_threshold": None if self.exit_threshold is None else float(self.exit_threshold),
            "exit_at_step": _optional_int("exit_at_step", self.exit_at_step, 0),
            "weighted_exit": bool(self.weighted_exit),
            "exit_tol": None if self.exit_tol is None else _number("exit_tol", self.exit_tol),
            "min_loops": _int("min_loops", self.min_loops, 1),
            "logprobs": _optional_int("logprobs", self.logprobs, 0),
        }
        if normal["logprobs"] is not None and normal["logprobs"] > MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {self.logprobs!r}")
        for name, value in normal.items():
            object.__setattr__(self, name, value)  # normalising in __post_init__: the object is not yet shared
        if self.loops is not None and self.l_warmup_tokens and self.l_warmup_loops > self.loops:
            raise ValueError(f"l_warmup_loops ({self.l_warmup_loops}) must not exceed loops ({self.loops})")

    def with_loops(self, loops: int) -> SamplingParams:
        """The same request at a resolved loop count."""
        return self if loops == self.loops else replace(self, loops=loops)

    def check_vocab(self, vocab_size: int) -> None:
        """Stop tokens must be ids of this vocabulary."""
        bad = [t for t in self.stop_tokens if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_tokens must be token ids in [0, {vocab_size}), got {min(bad)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator | None:
        """A fresh torch.Generator for this request's seed (None without a seed)."""
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
