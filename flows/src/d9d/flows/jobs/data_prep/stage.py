"""The data-preparation stage under the stage contract, in steps that a flow or a plain call sequences alike."""

from __future__ import annotations

from pathlib import Path

from d9d.core.data import INDEX_FILENAME, TokenShardFormatError, TokenShardSet
from d9d.flows.jobs.contract import (
    Completeness,
    PartialStage,
    StageDirectory,
    StageReporter,
    StageResult,
    Status,
)
from d9d.flows.jobs.data_prep.config import DataPrepConfig
from d9d.flows.jobs.data_prep.program import (
    RECORDED_PACKAGES,
    STAGE_NAME,
    TOKENIZER_FILE,
    DataPrepOutcome,
    DataPrepPlan,
    plan_data_prep,
    run_data_prep,
)
from d9d.flows.jobs.progress import NoProgress, Progress

REPORTER = StageReporter(
    STAGE_NAME,
    RECORDED_PACKAGES,
    lambda output, _: {
        "tokenizer": str(output / TOKENIZER_FILE),
        "train shards": str(output / "train"),
        "validation shards": str(output / "validation"),
    },
)


def check(directory: StageDirectory, plan: DataPrepPlan) -> Completeness:
    """The manifest check, plus every shard set's checksums: a corrupt shard makes the output incomplete, so the
    stage writes it again instead of skipping it."""
    completeness = directory.check(plan.key)
    if completeness.complete:
        for index in sorted(directory.target.rglob(INDEX_FILENAME)):
            try:
                TokenShardSet(index.parent)
            except TokenShardFormatError as error:
                return Completeness(
                    status=Status.INCOMPLETE, reason=f"corrupt token shards: {error}", manifest=completeness.manifest
                )
    return completeness


def skipped(plan: DataPrepPlan, completeness: Completeness) -> StageResult:
    return REPORTER.skipped(plan.output, completeness)


def commit(
    directory: StageDirectory, partial: PartialStage, plan: DataPrepPlan, outcome: DataPrepOutcome
) -> StageResult:
    return REPORTER.commit(
        directory, partial, plan.key, plan.output, outputs=outcome.outputs, statistics=outcome.statistics
    )


def prepare_data(
    config: DataPrepConfig, output: Path, *, progress: Progress | None = None, replace: bool = False
) -> StageResult:
    """The whole stage in this process, without an orchestrator: skip when complete, else run and commit
    (`replace`: replace a foreign or stale `output` instead of refusing, see `StageDirectory`)."""
    progress = progress or NoProgress()
    directory = StageDirectory(output, replace=replace)
    with directory.lock():
        plan = plan_data_prep(config, output)
        completeness = check(directory, plan)
        if completeness.complete:
            return skipped(plan, completeness)
        partial = directory.open_partial(plan.key)
        outcome = run_data_prep(plan, partial, progress=progress)
        result = commit(directory, partial, plan, outcome)
    return result.with_reason(completeness.reason)
