"""The data-preparation stage under the stage contract, in steps that a flow or a plain call sequences alike."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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
from d9d.flows.jobs.data_prep.prepare import (
    RECORDED_PACKAGES,
    STAGE_NAME,
    TOKENIZER_FILE,
    DataPrepOutcome,
    DataPrepPlan,
    plan_data_prep,
    preflight,
    run_data_prep,
)
from d9d.flows.jobs.progress import NoProgress, Progress
from d9d.flows.jobs.stage_spec import StageSpec

if TYPE_CHECKING:
    from d9d.flows.jobs.config import JobConfig

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


def run_stage(plan: DataPrepPlan, directory: StageDirectory, progress: Progress) -> StageResult:
    """Tokenize into the directory's partial directory (reusing what an earlier attempt finished) and commit."""
    partial = directory.open_partial(plan.key)
    return commit(directory, partial, plan, run_data_prep(plan, partial, progress=progress))


def _preflight(config: JobConfig) -> None:
    preflight(config.data_prep, config.data_prep_output)


SPEC: StageSpec[DataPrepPlan] = StageSpec(
    name=STAGE_NAME,
    section="data_prep",
    summary="raw text to a tokenizer and train/validation token shards under <workdir>/data",
    reads=lambda config: {},
    output=lambda config: config.data_prep_output,
    preflight=_preflight,
    plan=lambda config, progress: plan_data_prep(config.data_prep, config.data_prep_output),
    check=check,
    run=run_stage,
    skipped=skipped,
)
