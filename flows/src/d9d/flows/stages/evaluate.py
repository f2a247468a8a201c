"""The evaluate stage as a Prefect flow: plan, skip if the manifest says done, evaluate under torchrun, commit,
and publish the report as Prefect artifacts (a markdown report and a table, one row per checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from d9d.flows.console import current_progress
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import Completeness, StageDirectory, StageResult
from d9d.flows.jobs.evaluate.stage import (
    REPORT_MARKDOWN,
    EvaluatePlan,
    commit,
    plan_evaluate,
    run_evaluate_stage,
    skipped,
    table_rows,
)
from d9d.flows.jobs.progress import LogProgress, Progress
from d9d.flows.stages.inputs import require_complete


def _progress() -> Progress:
    return current_progress() or LogProgress(get_run_logger())


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
def plan_task(config: JobConfig) -> EvaluatePlan:
    require_complete(config.data_prep_output, "data-prep", "evaluate")
    require_complete(config.pretrain_output, "pretrain", "evaluate")
    if config.evaluate.finetune:
        require_complete(config.finetune_output, "finetune", "evaluate")
        require_complete(config.finetune_data_output, "finetune-data", "evaluate")
    return plan_evaluate(config.evaluate, config.evaluate_inputs(), config.evaluate_output)


@task(name="check-manifest", cache_policy=NO_CACHE, persist_result=False)
def check_task(directory: StageDirectory, plan: EvaluatePlan) -> Completeness:
    return directory.check(plan.key)


@task(name="evaluate", cache_policy=NO_CACHE, persist_result=False)
def evaluate_task(directory: StageDirectory, plan: EvaluatePlan) -> StageResult:
    partial = directory.open_partial(plan.key)
    statistics = run_evaluate_stage(plan, partial, _progress())
    return commit(directory, partial, plan, statistics)


@task(name="publish", cache_policy=NO_CACHE, persist_result=False)
def publish_task(result: StageResult) -> None:
    """The report as Prefect artifacts, so the flow run's page shows it."""
    markdown = Path(result.output, REPORT_MARKDOWN).read_text(encoding="utf-8")
    create_markdown_artifact(markdown, key="evaluation-report", description=f"evaluation of {result.output}")
    create_table_artifact(
        table_rows(result.statistics),
        key="evaluation-table",
        description=f"held-out loss per checkpoint and split, {result.output}",
    )


@flow(name="evaluate", persist_result=False, validate_parameters=False)
def evaluate_flow(job: dict[str, Any]) -> dict[str, Any]:
    """Held-out loss, perplexity and bits per byte of each checkpoint into `<workdir>/evaluation`."""
    config = JobConfig.model_validate(job)
    directory = StageDirectory(config.evaluate_output, replace=config.replace_outputs)
    progress = _progress()
    with directory.lock():
        plan = plan_task(config)
        completeness = check_task(directory, plan)
        if completeness.complete:
            progress.note(f"evaluate: skipped, {plan.output} is up to date ({completeness.reason})")
            result = skipped(plan, completeness)
        else:
            progress.note(
                f"evaluate: running {len(plan.checkpoints)} checkpoint(s) on {len(plan.splits)} split(s) "
                f"({completeness.reason})"
            )
            ran = evaluate_task(directory, plan)
            result = ran.with_reason(completeness.reason)
    publish_task(result)
    return result.to_json()
