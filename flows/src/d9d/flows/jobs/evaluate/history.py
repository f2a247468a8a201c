"""The evaluate stage's history: every committed report is kept beside the output, so the next run (a nightly one)
can say what changed.

    <workdir>/evaluation/            the newest report (the stage output, replaced by each run)
    <workdir>/evaluation-history/    20261126T013000Z.json, ... one evaluation.json per committed run, never replaced

The previous report is `evaluate.compare_with` when set (any earlier `evaluation.json`, e.g. another machine's
nightly), else the newest readable file of the history. Files that do not parse are skipped, not fatal: a
half-written or foreign file must not stop an evaluation. Records are written whole (temporary file, then rename),
after the stage has committed, so the history never names a report that does not exist.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HISTORY_SUFFIX = "-history"


def history_dir(output: Path) -> Path:
    """`<output>-history`, a sibling of the stage output (which each run replaces whole)."""
    return output.parent / f"{output.name}{HISTORY_SUFFIX}"


def read_report(path: Path) -> dict[str, Any]:
    """An earlier evaluation.json, with a clear error when it is not one."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"evaluate.compare_with={path}: cannot read an evaluation report there ({error})") from error
    if not isinstance(report, dict) or "checkpoints" not in report:
        raise ValueError(f"evaluate.compare_with={path}: not an evaluation.json (no 'checkpoints')")
    return report


def previous_report(output: Path, compare_with: Path | None) -> tuple[Path, dict[str, Any]] | None:
    """The report to compare with: `compare_with`, else the newest readable one in the history (None: none)."""
    if compare_with is not None:
        return compare_with, read_report(compare_with)
    directory = history_dir(output)
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("*.json"), reverse=True):  # names are UTC timestamps: newest first
        try:
            return path, read_report(path)
        except ValueError:
            continue
    return None


def record(output: Path, summary: dict[str, Any], *, now: datetime | None = None) -> Path:
    """Keep `summary` as `<history>/<UTC timestamp>.json`; returns its path."""
    directory = history_dir(output)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S%fZ")
    path = directory / f"{stamp}.json"
    staging = directory / f".{stamp}.json.tmp"
    staging.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    staging.replace(path)
    return path
