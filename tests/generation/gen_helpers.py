"""Engines for the generation tests: the random test-tiny model, and a contractive variant whose loop
state settles fast (so shallow drafts are often right and both accept paths run)."""

from __future__ import annotations

import torch

from helpers import random_flat_weights
from tinyloop.config import ArchConfig
from tinyloop.grammar.index import TokenIndex
from tinyloop.model.weights import ModelWeights
from tinyloop.presets import preset
from tinyloop.runtime.decode import Row
from tinyloop.runtime.depth_schedule import DepthSchedule
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.sampling import TokenPicker
from tinyloop.runtime.stats import GenerationStats
from tinyloop.sampling import SamplingParams


def tiny_engine(contractive: float | None = None, cfg: ArchConfig | None = None, seed: int = 7) -> Engine:
    cfg = cfg or preset("test-tiny")
    flat = random_flat_weights(cfg, seed)
    if contractive is not None:
        # Shrink how much the previous loop state feeds the next iteration (concat injection).
        flat["adapter.weight"][:, : cfg.d_model] *= contractive
    return Engine(cfg, ModelWeights.from_flat(cfg, flat), torch.device("cpu"), torch.float32)


def one_row(
    prompt: torch.Tensor,
    max_tokens: int,
    loops: int,
    params: SamplingParams,
    stats: GenerationStats | None = None,
    *,
    grammar: TokenIndex | None = None,
    stop_tokens: frozenset[int] = frozenset(),
    schedule: DepthSchedule | None = None,
) -> Row:
    """A request for `decode_row`."""
    picker = TokenPicker(params, grammar, stop_tokens)
    return Row(prompt, loops, max_tokens, picker, schedule, stats if stats is not None else GenerationStats())


PROMPTS = [b"The meaning of life is", b"Hello", b"0123456789 abc", b'{"a": [1, 2']
