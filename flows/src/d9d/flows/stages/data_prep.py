"""The data-preparation stage as a Prefect flow: plan, skip if the manifest says done, tokenize, commit.

Prefect's own result cache is off for every task here: the stage's manifest decides whether it is complete, so a
deleted or damaged output is redone whatever Prefect remembers. A retry (or a later run) of a failed attempt
reuses the pieces that attempt finished, through the records in the stage's partial directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from d9d.flows.console import current_progress
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import Completeness, PartialStage, StageDirectory, StageResult
from d9d.flows.jobs.data_prep import DataPrepConfig, DataPrepPlan, commit, plan_data_prep, run_data_prep, skipped
from d9d.flows.jobs.data_prep.stage import check as check_data_prep
from d9d.flows.jobs.progress import LogProgress, Progress


def _progress() -> Progress:
    return current_progress() or LogProgress(get_run_logger())


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
def plan_task(config: DataPrepConfig, output: Path) -> DataPrepPlan:
    return plan_data_prep(config, output)


@task(name="check-manifest", cache_policy=NO_CACHE, persist_result=False)
def check_task(directory: StageDirectory, plan: DataPrepPlan) -> Completeness:
    return check_data_prep(directory, plan)


@task(name="tokenize", cache_policy=NO_CACHE, persist_result=False)
def tokenize_task(directory: StageDirectory, plan: DataPrepPlan) -> StageResult:
    partial: PartialStage = directory.open_partial(plan.key)
    outcome = run_data_prep(plan, partial, progress=_progress())
    return commit(directory, partial, plan, outcome)


@flow(name="data-prep", persist_result=False, validate_parameters=False)
def data_prep_flow(job: dict[str, Any]) -> dict[str, Any]:
    """Raw text to a tokenizer and train/validation token shards under `job.data_prep.output`."""
    config = JobConfig.model_validate(job)
    output = config.data_prep_output
    directory = StageDirectory(output, replace=config.replace_outputs)
    progress = _progress()
    with directory.lock():
        plan = plan_task(config.data_prep, output)
        completeness = check_task(directory, plan)
        if completeness.complete:
            progress.note(f"data-prep: skipped, {output} is up to date ({completeness.reason})")
            return skipped(plan, completeness).to_json()
        progress.note(f"data-prep: running ({completeness.reason})")
        result = tokenize_task(directory, plan)
    return result.with_reason(completeness.reason).to_json()
