"""Fixtures for the cache tests: one open Model per KV mode over the session's test-tiny file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tinyloop.api.model import Model

MODES = {"16bit": 0, "int8": 0, "hidden": 0, "window": 6, "none": 0}


@pytest.fixture(scope="module")
def models(tiny_files: dict[str, Path]) -> Iterator[dict[str, Model]]:
    opened = {mode: Model(tiny_files["f32"], max_seq_len=96, kv_mode=mode, cache_window=w) for mode, w in MODES.items()}
    yield opened
    for m in opened.values():
        m.close()


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Toy shapes gain nothing from threads, and spinning OpenMP workers crawl on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
