"""Generation tests run many tiny single-token steps: one intra-op thread is fastest for them and is not
slowed down by other processes competing for the cores."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
