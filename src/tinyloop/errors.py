"""Exceptions that TinyLoop raises on bad files and bad runtime states."""

from __future__ import annotations


class TinyLoopFormatError(ValueError):
    """A `.tinyloop` file (or a checkpoint being converted) is not what it must be.

    The message names the file, the field or tensor, what was expected and what was found.
    """

    def __init__(self, path: object, what: str, expected: str, found: str) -> None:
        self.path = str(path)
        self.what = what
        self.expected = expected
        self.found = found
        super().__init__(f"{self.path}: {what}: expected {expected}, found {found}")


class ModelClosedError(RuntimeError):
    """Raised by every method of a closed Model."""

    def __init__(self) -> None:
        super().__init__("model was closed")


class OutOfMemoryError(RuntimeError):
    """Buffers could not be allocated; the message starts with 'out of memory'."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"out of memory: {detail}")


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits for a request; that request ends, the model stays usable."""

    def __init__(self) -> None:
        super().__init__(
            "the model produced non-finite logits (NaN or inf) for this request: the weights, or the "
            "activations for these tokens, overflow; the request was stopped and nothing it computed is reused"
        )


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. A TypeError, and a ValueError too, as the API raised for these before."""


class PrefixPoolFormatError(TinyLoopFormatError):
    """A saved prefix pool file (`PrefixPool.load`) is unreadable, malformed, corrupted, or not of this model.

    `what` names the entry and field (for example "entry 3 tensor 'kv.k'"), as in TinyLoopFormatError.
    """


class QueueFullError(RuntimeError):
    """A Scheduler's queue of waiting requests is full (max_queue): retry later."""
