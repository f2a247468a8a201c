"""Progress of long work, reported through a small interface so that jobs never depend on a display."""

from __future__ import annotations

import logging
import time
from typing import Protocol


class Progress(Protocol):
    """One task's progress: `start` once with the total, `advance` as units finish, `finish` at the end
    (`failed=True` when the work stopped on an error or a signal: no "done" is reported then).

    `note` reports a step that has no amount (what a stage decided, what it reuses).
    """

    def note(self, message: str) -> None: ...

    def start(self, description: str, total: float, unit: str) -> None: ...

    def advance(self, amount: float, note: str = "") -> None: ...

    def finish(self, *, failed: bool = False) -> None: ...


class LogProgress:
    """Progress as log lines, at most one per `every_fraction` of the total (for logs and non-interactive runs)."""

    def __init__(
        self, logger: logging.Logger | logging.LoggerAdapter[logging.Logger], every_fraction: float = 0.1
    ) -> None:
        self._logger = logger
        self._every = every_fraction
        self._description = ""
        self._total = 0.0
        self._unit = ""
        self._done = 0.0
        self._next_report = 0.0
        self._started = 0.0

    def note(self, message: str) -> None:
        self._logger.info("%s", message)

    def start(self, description: str, total: float, unit: str) -> None:
        self._description, self._total, self._unit = description, total, unit
        self._done, self._next_report, self._started = 0.0, total * self._every, time.perf_counter()
        self._logger.info("%s: 0 of %s %s", description, _amount(total), unit)

    def advance(self, amount: float, note: str = "") -> None:
        self._done += amount
        if amount > 0 and (self._done >= self._next_report or self._done >= self._total):  # a note alone: no line
            self._next_report = self._done + self._total * self._every
            share = 100.0 * self._done / self._total if self._total else 100.0
            self._logger.info(
                "%s: %.0f%% (%s of %s %s)%s",
                self._description,
                share,
                _amount(self._done),
                _amount(self._total),
                self._unit,
                f", {note}" if note else "",
            )

    def finish(self, *, failed: bool = False) -> None:
        seconds = time.perf_counter() - self._started
        if failed:
            self._logger.info("%s: stopped after %.1f s (%s of %s %s)", self._description, seconds,
                              _amount(self._done), _amount(self._total), self._unit)  # fmt: skip
        elif self._done > 0:
            self._logger.info(
                "%s: done in %.1f s (%s)", self._description, seconds, rate(self._done, seconds, self._unit)
            )
        else:  # nothing counted: no "0.0 units/s"
            self._logger.info("%s: done in %.1f s", self._description, seconds)


class NoProgress:
    def note(self, message: str) -> None:
        pass

    def start(self, description: str, total: float, unit: str) -> None:
        pass

    def advance(self, amount: float, note: str = "") -> None:
        pass

    def finish(self, *, failed: bool = False) -> None:
        pass


def _amount(value: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}"


def rate(done: float, seconds: float, unit: str) -> str:
    """How fast, readable at any speed: `12.3 steps/s`, or `4.2 s/evaluation` below one per second."""
    if unit == "B":
        return f"{done / max(seconds, 1e-9) / 1e6:.2f} MB/s"
    per_second = done / max(seconds, 1e-9)
    if per_second >= 1 or done == 0:
        return f"{per_second:.1f} {unit}/s"
    return f"{seconds / done:.1f} s/{unit.removesuffix('s')}"
