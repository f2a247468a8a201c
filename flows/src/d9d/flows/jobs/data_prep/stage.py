"""The data-preparation stage under the stage contract, in steps that a flow or a plain call sequences alike."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from d9d.flows.jobs.contract import (
    Completeness,
    PartialStage,
    StageDirectory,
    StageReporter,
    StageResult,
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


def skipped(plan: DataPrepPlan, completeness: Completeness) -> StageResult:
    return REPORTER.skipped(plan.output, completeness)


def commit(
    directory: StageDirectory, partial: PartialStage, plan: DataPrepPlan, outcome: DataPrepOutcome
) -> StageResult:
    return REPORTER.commit(
        directory, partial, plan.key, plan.output, outputs=outcome.outputs, statistics=outcome.statistics
    )


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
    return result.with_reason(completeness.reason)


def run_stage(plan: DataPrepPlan, directory: StageDirectory, progress: Progress) -> StageResult:
    """Tokenize into the directory's partial directory (reusing what an earlier attempt finished) and commit."""
    partial = directory.open_partial()
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
    run=run_stage,
    skipped=skipped,
)
