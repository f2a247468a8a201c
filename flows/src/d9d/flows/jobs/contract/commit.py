"""Committing a stage's output and reporting it: the steps every stage ends with, whether it ran or was skipped."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from d9d.flows.jobs.contract.fingerprint import package_versions
from d9d.flows.jobs.contract.manifest import MANIFEST_FILENAME, StageKey
from d9d.flows.jobs.contract.result import StageResult, StageStatus
from d9d.flows.jobs.contract.stage_directory import Completeness, PartialStage, StageDirectory


@dataclass(frozen=True)
class StageReporter:
    """One stage's name, the packages whose versions its manifest records, and its artifacts (label -> path, for the
    summary) given its output directory and statistics."""

    stage: str
    packages: tuple[str, ...]
    artifacts: Callable[[Path, Mapping[str, Any]], dict[str, str]]

    def commit(
        self,
        directory: StageDirectory,
        partial: PartialStage,
        key: StageKey,
        output: Path,
        *,
        outputs: Sequence[str],
        statistics: dict[str, Any],
    ) -> StageResult:
        """Commit `partial` as the output for `key`, stamped with the current UTC time (to the second)."""
        manifest = directory.commit(
            partial,
            key,
            outputs=outputs,
            packages=package_versions(self.packages),
            statistics=statistics,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        return self.result(output, "ran", "", manifest.statistics)

    def skipped(self, output: Path, completeness: Completeness) -> StageResult:
        """A complete output left as it is, with the statistics its manifest recorded."""
        assert completeness.manifest is not None
        return self.result(output, "skipped", f"up to date: {completeness.reason}", completeness.manifest.statistics)

    def result(self, output: Path, status: StageStatus, reason: str, statistics: Mapping[str, Any]) -> StageResult:
        return StageResult(
            stage=self.stage,
            status=status,
            reason=reason,
            output=str(output),
            manifest=str(output / MANIFEST_FILENAME),
            artifacts=self.artifacts(output, statistics),
            statistics=dict(statistics),
        )
