"""Prompts prefilled on the rows of a staging cache, in chunks, before each is copied into its slot.

The scheduler decides which prompt chunks run in a step (its budget, the free slots, the prefix pool); this
runs them: a row starts empty or from a pool prefix, a round's chunks run as one batched forward or one
forward per row, a finished prompt's K/V are taken as a snapshot for its slot, and a prompt the budget cut
moves to row 0 to go on next step.
"""

from __future__ import annotations

import torch

from tinyloop.cache.base import ModeCache, empty_row
from tinyloop.runtime.engine import Engine


class StagedPrefill:
    """The staging rows of one scheduler (`staging` None: kv_mode 'none', where every prompt runs whole and
    nothing is kept between steps)."""

    def __init__(self, engine: Engine, staging: ModeCache | None) -> None:
        self.engine = engine
        self.staging = staging
        # Whether a round's prompts run as one batched forward. A GPU's prefill step costs mostly host time
        # whatever its rows; a CPU's is bound by its arithmetic, and its fast path prefills one row at a time
        # (batched, the prompts would take the generic forward: the batch job 17 % slower, measured).
        self.together = engine.device.type != "cpu"

    def clear_row(self, row: int) -> None:
        if self.staging is not None:
            empty_row(self.staging, row)

    def start_from(self, kv: dict[str, torch.Tensor], length: int, loops: int, reuse: int, row: int) -> None:
        """Row `row` begins with the first `reuse` positions of a snapshot of `length` tokens."""
        assert self.staging is not None
        self.staging.restore(kv, length, loops, reuse, row=row)

    def snapshot(self, length: int, loops: int, row: int) -> dict[str, torch.Tensor]:
        assert self.staging is not None
        return self.staging.snapshot(length, loops, row=row)

    def run(self, chunks: list[torch.Tensor], loops: list[int]) -> tuple[torch.Tensor, int]:
        """The chunks on rows 0.. (one forward, or one per row where not `together`): the logits
        [len(chunks), V] after each, and the forwards run."""
        if self.together:
            return self._forward(chunks, loops, 0), 1
        one_by_one = [self._forward([chunk], [loops[b]], b) for b, chunk in enumerate(chunks)]
        return torch.cat(one_by_one), len(chunks)

    def _forward(self, chunks: list[torch.Tensor], loops: list[int], first: int) -> torch.Tensor:
        """One forward of the chunks, right-padded, over rows [first, first + len(chunks))."""
        valid = torch.tensor([len(c) for c in chunks], dtype=torch.long)
        tokens = torch.zeros(len(chunks), int(valid.max()), dtype=torch.long)
        for b, c in enumerate(chunks):
            tokens[b, : len(c)] = c
        depth = torch.tensor(loops, dtype=torch.long)
        staging = self.staging
        if staging is None:
            out = self.engine.step(tokens, None, max(loops), valid=valid, last_only=True, depth=depth)
        else:
            view = staging.rows(first, len(chunks))
            out = self.engine.step(tokens, view, max(loops), valid=valid, last_only=True, depth=depth)
            staging.absorb(view)
        assert out.logits is not None
        return out.logits[:, -1]

    def move_to_first_row(self, length: int, loops: int, row: int) -> None:
        """Row `row`'s first `length` positions (a prompt the budget cut) go on from row 0."""
        if row != 0 and self.staging is not None:
            kv = self.staging.snapshot(length, loops, row=row)
            self.staging.restore(kv, length, loops, length, row=0)
