"""The pretrain stage as a Prefect flow: plan, skip if the manifest says done, train under torchrun, commit.

The job's `pretrain` section is a `PretrainStageConfig`; the stage reads the data-prep stage's train split (and the
convert stage's checkpoint, when it fits the model) and writes `<workdir>/pretrain`. The ranks run in their own
process tree; cancelling the flow run (SIGTERM from a Prefect worker, Ctrl-C, `kill`) makes them checkpoint and
stop (`d9d.flows.jobs.launch`), and the next run resumes from that checkpoint. Prefect's result cache is off.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from d9d.flows.console import current_progress
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import Completeness, StageDirectory, StageResult
from d9d.flows.jobs.pretrain.stage import (
    PretrainPlan,
    commit,
    plan_pretrain,
    prepare_partial,
    run_pretrain_stage,
    skipped,
)
from d9d.flows.jobs.progress import LogProgress, Progress
from d9d.flows.stages.inputs import require_complete


def _progress() -> Progress:
    return current_progress() or LogProgress(get_run_logger())


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
def plan_task(config: JobConfig) -> PretrainPlan:
    require_complete(config.data_prep_output, "data-prep", "pretrain")
    return plan_pretrain(
        config.pretrain,
        config.pretrain_output,
        train_shards=config.data_prep_output / "train",
        convert_checkpoint=config.convert_output / "checkpoint",
    )


@task(name="check-manifest", cache_policy=NO_CACHE, persist_result=False)
def check_task(directory: StageDirectory, plan: PretrainPlan) -> Completeness:
    return directory.check(plan.key)


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train_task(directory: StageDirectory, plan: PretrainPlan) -> StageResult:
    progress = _progress()
    partial = directory.open_partial(plan.key)
    progress.note(f"pretrain: {prepare_partial(partial, plan.key)} on {plan.config.nproc_per_node} ranks")
    statistics = run_pretrain_stage(plan, partial, progress)
    return commit(directory, partial, plan, statistics)


@flow(name="pretrain", persist_result=False, validate_parameters=False)
def pretrain_flow(job: dict[str, Any]) -> dict[str, Any]:
    """Train the job's model on the train split into `<workdir>/pretrain` (job checkpoints, losses, the log)."""
    config = JobConfig.model_validate(job)
    directory = StageDirectory(config.pretrain_output, replace=config.replace_outputs)
    progress = _progress()
    with directory.lock():
        plan = plan_task(config)
        completeness = check_task(directory, plan)
        if completeness.complete:
            progress.note(f"pretrain: skipped, {plan.output} is up to date ({completeness.reason})")
            return skipped(plan, completeness).to_json()
        progress.note(f"pretrain: running ({completeness.reason}); starts from {plan.init_note}")
        result = train_task(directory, plan)
    return result.with_reason(completeness.reason).to_json()
