"""Engines for the generation tests: the random test-tiny model, and a contractive variant whose loop
state settles fast (so shallow drafts are often right and both accept paths run)."""

from __future__ import annotations

import torch

from helpers import random_flat_weights
from tinyloop.config import ArchConfig
from tinyloop.model.weights import ModelWeights
from tinyloop.presets import preset
from tinyloop.runtime.engine import Engine


def tiny_engine(contractive: float | None = None, cfg: ArchConfig | None = None, seed: int = 7) -> Engine:
    cfg = cfg or preset("test-tiny")
    flat = random_flat_weights(cfg, seed)
    if contractive is not None:
        # Shrink how much the previous loop state feeds the next iteration (concat injection).
        flat["adapter.weight"][:, : cfg.d_model] *= contractive
    return Engine(cfg, ModelWeights.from_flat(cfg, flat), torch.device("cpu"), torch.float32)


PROMPTS = [b"The meaning of life is", b"Hello", b"0123456789 abc", b'{"a": [1, 2']
