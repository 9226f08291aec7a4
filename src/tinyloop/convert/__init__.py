"""Producing `.tinyloop` files: random-weight models and conversion of canonical checkpoints."""

from __future__ import annotations

from tinyloop.convert.from_checkpoint import convert_checkpoint, load_checkpoint
from tinyloop.convert.random_model import random_weights, write_random_model

__all__ = ["convert_checkpoint", "load_checkpoint", "random_weights", "write_random_model"]
