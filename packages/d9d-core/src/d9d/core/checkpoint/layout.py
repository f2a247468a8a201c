"""Where job checkpoints live and which of them are complete.

`<root>/step-00000010/` holds one checkpoint: DCP files, `rng/rank-XXXXX.json` per rank and, written last by rank 0
after every rank finished, the completion marker `COMPLETE`. A folder without the marker is an interrupted write:
never loaded, removed by the next retention pass once a newer complete checkpoint exists.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Every checkpoint folder (complete or not) under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(step, path) for path in root.iterdir() if path.is_dir() and (step := step_of(path)) is not None]
    return sorted(found)


def latest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    complete = [path for _, path in list_checkpoints(root) if is_complete(path)]
    return complete[-1] if complete else None


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and incomplete ones older than the newest
    complete one. The newest complete checkpoint is never deleted. Returns what was removed."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: at least one complete checkpoint must be kept")
    entries = list_checkpoints(root)
    complete = [(step, path) for step, path in entries if is_complete(path)]
    if not complete:
        return []
    kept = {path for _, path in complete[-keep_last:]}
    newest_step = complete[-1][0]
    removed = []
    for step, path in entries:
        stale_incomplete = not is_complete(path) and step < newest_step
        if (is_complete(path) and path not in kept) or stale_incomplete:
            shutil.rmtree(path)
            removed.append(path)
    return removed
