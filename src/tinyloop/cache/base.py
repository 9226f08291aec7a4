"""The contracts every KV-cache mode meets: what the engine steps over, and what snapshots need."""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch

from tinyloop.cache.memory import check_host_memory
from tinyloop.config import ArchConfig
from tinyloop.errors import OutOfMemoryError
from tinyloop.model.layers import StepContext


class StepCache(Protocol):
    """What `Engine.step` and the decode loop need: a KV store plus its length bookkeeping.

    A store may also define `begin_step(positions, start, valid) -> mask` ([B, 1, T, S] bool); the
    engine then uses that mask instead of its own (the sliding window attends over a ring, not 0..end).
    """

    loops: int
    max_seq: int
    lengths: torch.Tensor

    def update(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def truncate(self, length: int | torch.Tensor) -> None: ...


class ModeCache(StepCache, Protocol):
    """A working cache of one KV mode, able to export and import a prefix of row 0.

    snapshot(length, loops, row): independent copies of what positions [0, length) of the slots used at
    `loops` hold in `row` (default 0; only those positions: a snapshot's size grows with its length, not
    with max_seq).
    restore(tensors, length, loops, use, row): load such a snapshot into `row` (default 0) and keep its
    first `use` tokens; `can_use(length, use)` says whether that truncation is exact in this mode.
    clear_row(row): zero a row's buffers and length (after a failed request: nothing it wrote is read again).
    leading(n) / rows(first, n) / absorb(view): a cache over rows [0, n) (or [first, first + n)) sharing the
    buffers (a step over fewer rows), and taking back the bookkeeping (lengths, ring positions) a step over it
    replaced.
    """

    mode: str

    @property
    def nbytes(self) -> int: ...

    def snapshot(self, length: int, loops: int, row: int = 0) -> dict[str, torch.Tensor]: ...

    def restore(self, tensors: dict[str, torch.Tensor], length: int, loops: int, use: int, row: int = 0) -> None: ...

    def clear_row(self, row: int) -> None: ...

    def leading(self, n: int) -> ModeCache: ...

    def rows(self, first: int, n: int) -> ModeCache: ...

    def absorb(self, view: ModeCache) -> None: ...

    def can_use(self, length: int, use: int) -> bool: ...

    def check_integrity(self) -> None: ...


def empty_row(cache: StepCache, row: int) -> None:
    """Row `row` holds no tokens from now on (its buffers stay: what comes next overwrites them)."""
    lengths = cache.lengths.clone()
    lengths[row] = 0
    cache.truncate(lengths)


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, what: str) -> torch.Tensor:
    """A zeroed buffer, or OutOfMemoryError ('out of memory: ...') before or instead of a crash."""
    dev = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    check_host_memory(dev, nbytes)
    try:
        # Zeros, not empty: masked-out entries still enter the attention matmul (0 * NaN = NaN).
        return torch.zeros(shape, dtype=dtype, device=dev)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        raise OutOfMemoryError(f"{what} of {nbytes / 2**20:.1f} MiB {tuple(shape)} on {dev}: {exc}") from None


def copy_out(t: torch.Tensor, what: str) -> torch.Tensor:
    """An owned, contiguous copy (snapshots must not alias the working cache)."""
    return allocate(tuple(t.shape), t.dtype, t.device, what).copy_(t)


def row_lengths(length: int | torch.Tensor, batch: int) -> torch.Tensor:
    return torch.as_tensor(length, dtype=torch.long).expand(batch).clone()


class RowViews:
    """leading(n) / absorb(view) for caches whose buffers have the batch on axis 1 ([slots, B, ...]) and
    whose per-row bookkeeping (`_row_state`, batch on axis 0) a step replaces rather than writes into."""

    lengths: torch.Tensor
    _row_state: tuple[str, ...] = ("lengths",)

    def _row_buffers(self) -> list[str]:
        """Attributes holding [slots, B, ...] buffers."""
        return ["k", "v"]

    _first_row = 0  # where a view's rows start in the cache it was taken from

    def leading(self, n: int) -> Any:
        return self.rows(0, n)

    def rows(self, first: int, n: int) -> Any:
        view = copy.copy(self)
        for name in self._row_buffers():
            setattr(view, name, getattr(self, name).narrow(1, first, n))
        for name in self._row_state:
            setattr(view, name, getattr(self, name)[first : first + n].clone())
        rows = getattr(self, "_rows", None)
        if rows is not None:
            view._rows = rows[:n]  # type: ignore[attr-defined]  # row indices within the view's buffers
        view._first_row = first
        return view

    def absorb(self, view: Any) -> None:
        first = view._first_row
        for name in self._row_state:
            part = getattr(view, name)
            whole = getattr(self, name).clone()
            whole[first : first + part.shape[0]] = part
            setattr(self, name, whole)


class PositionalSnapshots(RowViews):
    """snapshot/restore for caches whose buffers hold position p at index p ([slots, B, ..., max_seq, ...])."""

    cfg: ArchConfig
    loops: int
    max_seq: int
    lengths: torch.Tensor

    def _positional(self) -> dict[str, tuple[torch.Tensor, int]]:
        """name -> (buffer, the buffer's position axis)."""
        raise NotImplementedError

    def _row_buffers(self) -> list[str]:
        return list(self._positional())

    def snapshot(self, length: int, loops: int, row: int = 0) -> dict[str, torch.Tensor]:
        if not 0 < length <= int(self.lengths[row]) or loops > self.loops:
            raise ValueError(f"cannot snapshot {length} tokens at {loops} loops from a cache row holding "
                             f"{int(self.lengths[row])} tokens at {self.loops} loops")  # fmt: skip
        n = self.cfg.n_cache_slots(loops)
        return {
            name: copy_out(buf[:n, row].narrow(axis - 1, 0, length), "prefix snapshot")
            for name, (buf, axis) in self._positional().items()
        }

    def restore(self, tensors: dict[str, torch.Tensor], length: int, loops: int, use: int, row: int = 0) -> None:
        if loops > self.loops or not 0 <= use <= length or use > self.max_seq:
            raise ValueError(f"cannot restore {use} of {length} tokens at {loops} loops into a cache of "
                             f"{self.max_seq} tokens at {self.loops} loops")  # fmt: skip
        n = self.cfg.n_cache_slots(loops)
        for name, (buf, axis) in self._positional().items():
            src = tensors[name]
            if src.shape[0] != n or src.shape[axis - 1] != length:
                raise ValueError(f"snapshot tensor {name!r} has shape {tuple(src.shape)}, not {n} slots x {length}")
            buf[:n, row].narrow(axis - 1, 0, use).copy_(src.narrow(axis - 1, 0, use))
        self.lengths = self.lengths.clone()
        self.lengths[row] = use

    def clear_row(self, row: int) -> None:
        for buf, _ in self._positional().values():
            buf[:, row].zero_()
        self.lengths = self.lengths.clone()
        self.lengths[row] = 0

    def can_use(self, length: int, use: int) -> bool:
        return 0 <= use <= length
