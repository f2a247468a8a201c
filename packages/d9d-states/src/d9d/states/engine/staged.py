"""A checkpoint written by one or more ranks into a staging directory and published only if all succeeded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from d9d.states.engine.ranks import Ranks
from d9d.states.errors import CheckpointError
from d9d.states.io.commit import discard, new_staging_dir, publish
from d9d.states.io.shards import WrittenFile


@dataclass(frozen=True)
class _Outcome:
    files: list[WrittenFile]
    error: str | None = None


def write_staged(
    destination: Path, ranks: Ranks, body: Callable[[Path], list[WrittenFile]], *, overwrite: bool
) -> list[str]:
    """Run `body(staging_dir)` on every rank, then publish every rank's files as one checkpoint at `destination`.

    Collective over `ranks`. If any rank fails, nothing is published, the staging directory is removed, and every
    rank raises (the failing rank its own error, the others a `CheckpointError` naming it). Returns the file names.
    """
    staging = _create_staging(destination, ranks, overwrite=overwrite)
    local_error: Exception | None = None
    try:
        outcome = _Outcome(files=body(staging))
    except Exception as caught:  # noqa: BLE001 - reported to every rank below, then re-raised here
        local_error = caught
        outcome = _Outcome(files=[], error=f"rank {ranks.rank}: {type(caught).__name__}: {caught}")
    except BaseException:
        if ranks.size == 1:  # interrupted: nobody else will clean up
            discard(staging)
        raise
    outcomes: list[_Outcome] = ranks.all_gather(outcome)
    failures = [o.error for o in outcomes if o.error is not None]
    result: tuple[list[str] | None, str | None] = (None, None)
    if ranks.is_first:
        result = _publish_or_discard(staging, destination, outcomes, failures, overwrite=overwrite)
    names, publish_error = ranks.broadcast_from_first(result)
    if local_error is not None:
        raise local_error
    if failures:
        raise CheckpointError(f"{destination}: not written, because {'; '.join(failures)}")
    if publish_error is not None or names is None:
        raise CheckpointError(publish_error or f"{destination}: not published")
    return list(names)


def _create_staging(destination: Path, ranks: Ranks, *, overwrite: bool) -> Path:
    staging, error = None, None
    if ranks.is_first:
        try:
            staging = new_staging_dir(destination, overwrite=overwrite)
        except (CheckpointError, OSError) as caught:
            error = str(caught)
    staging, error = ranks.broadcast_from_first((staging, error))
    if error is not None or staging is None:
        raise CheckpointError(error or f"{destination}: no staging directory")
    return Path(staging)


def _publish_or_discard(
    staging: Path, destination: Path, outcomes: list[_Outcome], failures: list[str], *, overwrite: bool
) -> tuple[list[str] | None, str | None]:
    if failures:
        discard(staging)
        return None, None
    try:
        return publish(staging, destination, [f for o in outcomes for f in o.files], overwrite=overwrite), None
    except (CheckpointError, OSError) as caught:
        return None, str(caught)
