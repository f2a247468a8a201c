"""What a stage checks about the stages it reads from before it starts."""

from __future__ import annotations

from pathlib import Path

from d9d.flows.jobs.contract import ManifestError, StageManifest


class MissingInputError(RuntimeError):
    """A stage's input is not a complete stage output (names the stage to run first)."""


def require_complete(output: Path, stage: str, reader: str) -> StageManifest:
    """The manifest of `stage`'s output at `output`; a clear error if that stage has not completed."""
    try:
        return StageManifest.read(output)
    except ManifestError as error:
        raise MissingInputError(
            f"{reader} reads the output of {stage} at {output}, which is not complete ({error}); "
            f"run `d9d run {stage}` (or the pipeline) first"
        ) from error
