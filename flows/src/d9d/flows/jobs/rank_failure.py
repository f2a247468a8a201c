"""The failing rank's own error, read back from a launch's log, so a user sees the cause and not "see launch.log".

`torchrun` runs the ranks with their output interleaved in the log and ends with its own `ChildFailedError`
traceback; the cause is the last traceback a rank printed before that. Its final lines (the innermost frames and
the exception) are what a user needs; the whole log stays on disk for the rest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from d9d.flows.jobs.launch import LaunchError

TRACEBACK = "Traceback (most recent call last):"
LAUNCHER_ERRORS = ("torch.distributed.elastic", "ChildFailedError")


class RankProgramError(LaunchError):
    """A rank program failed; the message is its rank's own error (the last lines of its traceback)."""


def last_rank_error(log: str, *, lines: int = 6) -> str | None:
    """The last lines of the last traceback a rank printed in `log` (torchrun's own traceback skipped).

    A rank with a process group prints its uncaught traceback with each line prefixed `[rankN]: ` (torch's excepthook),
    and the ranks' lines interleave in the log: each rank's traceback is followed on its own prefix, and shown
    without it.
    """
    found: list[list[str]] = []
    current: dict[str, list[str]] = {}  # rank prefix ("" for none) -> the traceback it is printing
    for raw in log.splitlines():
        prefix, line = _split_rank_prefix(raw)
        if line.strip() == TRACEBACK:
            current[prefix] = [line]
            continue
        block = current.get(prefix)
        if block is None:
            continue
        block.append(line)
        if line and not line[0].isspace() and not line.startswith(TRACEBACK):
            found.append(block)  # the exception line ends a traceback
            del current[prefix]
    ranks = [block for block in found if not any(marker in block[-1] for marker in LAUNCHER_ERRORS)]
    if not ranks:
        return None
    return "\n".join(line.rstrip() for line in ranks[-1][-lines:])


def _split_rank_prefix(line: str) -> tuple[str, str]:
    """(`[rankN]:`, the rest) for a line torch prefixed with its rank, ("", line) otherwise."""
    match = _RANK_PREFIX.match(line)
    return (match.group(1), line[match.end() :]) if match else ("", line)


_RANK_PREFIX = re.compile(r"(\[rank\d+\]:) ?")


@contextmanager
def rank_errors(log_file: Path, describe: Callable[[str], str]) -> Iterator[None]:
    """Turn a `LaunchError` into a `RankProgramError` whose message is `describe(the rank's own error)`."""
    start = log_file.stat().st_size if log_file.is_file() else 0  # this attempt's lines only
    try:
        yield
    except LaunchError as error:
        with log_file.open(encoding="utf-8", errors="replace") as handle:
            handle.seek(start)
            cause = last_rank_error(handle.read())
        if cause is None:
            raise
        raise RankProgramError(f"{describe(cause)}\n(full log: {log_file})") from error
