"""The data-preparation stage under the stage contract, in steps that a flow or a plain call sequences alike."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from d9d.flows.jobs.contract import (
    MANIFEST_FILENAME,
    Completeness,
    PartialStage,
    StageDirectory,
    StageResult,
    StageStatus,
)
from d9d.flows.jobs.data_prep.config import DataPrepConfig
from d9d.flows.jobs.data_prep.program import (
    STAGE_NAME,
    TOKENIZER_FILE,
    DataPrepOutcome,
    DataPrepPlan,
    plan_data_prep,
    recorded_packages,
    run_data_prep,
)
from d9d.flows.jobs.progress import NoProgress, Progress


def skipped(plan: DataPrepPlan, completeness: Completeness) -> StageResult:
    assert completeness.manifest is not None
    return _result(plan.output, "skipped", f"up to date: {completeness.reason}", completeness.manifest.statistics)


def commit(
    directory: StageDirectory, partial: PartialStage, plan: DataPrepPlan, outcome: DataPrepOutcome
) -> StageResult:
    manifest = directory.commit(
        partial,
        plan.key,
        outputs=outcome.outputs,
        packages=recorded_packages(),
        statistics=outcome.statistics,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    return _result(plan.output, "ran", "", manifest.statistics)


def prepare_data(config: DataPrepConfig, output: Path, *, progress: Progress | None = None) -> StageResult:
    """The whole stage in this process, without an orchestrator: skip when complete, else run and commit."""
    progress = progress or NoProgress()
    directory = StageDirectory(output)
    with directory.lock():
        plan = plan_data_prep(config, output)
        completeness = directory.check(plan.key)
        if completeness.complete:
            return skipped(plan, completeness)
        partial = directory.open_partial()
        outcome = run_data_prep(plan, partial, progress=progress)
        result = commit(directory, partial, plan, outcome)
    return StageResult(**{**result.to_json(), "reason": completeness.reason})


def _result(output: Path, status: StageStatus, reason: str, statistics: dict[str, Any]) -> StageResult:
    return StageResult(
        stage=STAGE_NAME,
        status=status,
        reason=reason,
        output=str(output),
        manifest=str(output / MANIFEST_FILENAME),
        artifacts={
            "tokenizer": str(output / TOKENIZER_FILE),
            "train shards": str(output / "train"),
            "validation shards": str(output / "validation"),
        },
        statistics=dict(statistics),
    )
