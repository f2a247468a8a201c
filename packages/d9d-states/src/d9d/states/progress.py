"""Progress bars for long conversions, shown only when stderr is a terminal (never in logs or CI)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Protocol

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information


class ProgressBar(Protocol):
    def update(self, n: int) -> object: ...

    def close(self) -> None: ...

    def __enter__(self) -> ProgressBar: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> object: ...


# tqdm's monitor is a background thread that nudges stalled bars; a library must not start threads behind its
# callers' backs (forking test ranks refuse to run beside one), so our bars go without it.
_Bar = type("_Bar", (tqdm,), {"monitor_interval": 0})


def progress_bar(
    total_bytes: int, description: str, *, enabled: bool | None = None, position: int | None = None
) -> ProgressBar:
    """A byte-counting bar; `enabled=None` shows it only when stderr is a TTY. Use `update(n)` and `close()`."""
    show = sys.stderr.isatty() if enabled is None else enabled
    bar: ProgressBar = _Bar(
        total=total_bytes,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not show,
        position=position,
        leave=position is None,
        dynamic_ncols=True,
    )
    return bar
