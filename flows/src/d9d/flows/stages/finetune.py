"""The fine-tune stage as a Prefect flow: plan, skip if the manifest says done, fine-tune under torchrun, commit.

The job's `finetune` section is a `FinetuneStageConfig`; the stage reads the pretrain stage's newest checkpoint
and the finetune-data stage's splits, and writes `<workdir>/finetune`. Cancelling the flow run makes the ranks
checkpoint (the adapters) and stop, as for pretrain; the next run resumes. Prefect's result cache is off.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from d9d.flows.console import current_progress
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import Completeness, StageDirectory, StageResult
from d9d.flows.jobs.finetune.stage import (
    FinetuneInputs,
    FinetunePlan,
    commit,
    plan_finetune,
    run_finetune_stage,
    skipped,
)
from d9d.flows.jobs.pretrain.stage import prepare_partial
from d9d.flows.jobs.progress import LogProgress, Progress
from d9d.flows.stages.inputs import require_complete


def _progress() -> Progress:
    return current_progress() or LogProgress(get_run_logger())


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
def plan_task(config: JobConfig) -> FinetunePlan:
    require_complete(config.pretrain_output, "pretrain", "finetune")
    require_complete(config.finetune_data_output, "finetune-data", "finetune")
    inputs = FinetuneInputs(
        model=config.pretrain.model,
        seq_len=config.pretrain.seq_len,
        pretrain_output=config.pretrain_output,
        data_output=config.finetune_data_output,
    )
    return plan_finetune(config.finetune, inputs, config.finetune_output)


@task(name="check-manifest", cache_policy=NO_CACHE, persist_result=False)
def check_task(directory: StageDirectory, plan: FinetunePlan) -> Completeness:
    return directory.check(plan.key)


@task(name="finetune", cache_policy=NO_CACHE, persist_result=False)
def finetune_task(directory: StageDirectory, plan: FinetunePlan) -> StageResult:
    progress = _progress()
    partial = directory.open_partial(plan.key)
    progress.note(f"finetune: {prepare_partial(partial, plan.key)} on {plan.config.nproc_per_node} ranks")
    statistics = run_finetune_stage(plan, partial, progress)
    return commit(directory, partial, plan, statistics)


@flow(name="finetune", persist_result=False, validate_parameters=False)
def finetune_flow(job: dict[str, Any]) -> dict[str, Any]:
    """Fine-tune the pretrained model on the fine-tune corpus into `<workdir>/finetune` (adapter, merged weights)."""
    config = JobConfig.model_validate(job)
    directory = StageDirectory(config.finetune_output, replace=config.replace_outputs)
    progress = _progress()
    with directory.lock():
        plan = plan_task(config)
        completeness = check_task(directory, plan)
        if completeness.complete:
            progress.note(f"finetune: skipped, {plan.output} is up to date ({completeness.reason})")
            return skipped(plan, completeness).to_json()
        progress.note(f"finetune: running {config.finetune.peft.kind} ({completeness.reason})")
        result = finetune_task(directory, plan)
    return result.with_reason(completeness.reason).to_json()
