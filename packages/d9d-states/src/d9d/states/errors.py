"""Error types. Every message names the tensors (and, for files, the file) it is about."""

from __future__ import annotations

from collections.abc import Iterable

_SHOWN_NAMES = 8


class StatesError(ValueError):
    """Base of every error raised by d9d.states."""


class MappingError(StatesError):
    """A mapping is inconsistent: conflicting writers, missing inputs, cycles, impossible shapes.

    Raised while the plan is built, before any tensor data is read.
    """


class CheckpointError(StatesError):
    """A checkpoint on disk is unusable: a missing, truncated or corrupt file, or an inconsistent index."""


class StateMismatchError(StatesError):
    """Mapped states do not fit their target: unexpected or missing keys, shape or dtype mismatches."""


def describe_names(names: Iterable[str], limit: int = _SHOWN_NAMES) -> str:
    """`'a', 'b', 'c' and 12 more`: a bounded, sorted list of names for error messages."""
    ordered = sorted(names)
    shown = ", ".join(repr(name) for name in ordered[:limit])
    rest = len(ordered) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown
