"""The finetune-data stage as a Prefect flow: the data-prep stage's tasks on the fine-tune corpus, tokenized with
the data-prep stage's `tokenizer.json` into `<workdir>/finetune-data`; skipped when its manifest matches."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from d9d.flows.console import current_progress
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import StageDirectory, StageResult
from d9d.flows.jobs.data_prep import skipped
from d9d.flows.jobs.progress import LogProgress
from d9d.flows.stages.data_prep import check_task, plan_task, tokenize_task
from d9d.flows.stages.inputs import require_complete


@flow(name="finetune-data", persist_result=False, validate_parameters=False)
def finetune_data_flow(job: dict[str, Any]) -> dict[str, Any]:
    """The fine-tune corpus to train/validation token shards with the pretrain data's tokenizer."""
    config = JobConfig.model_validate(job)
    require_complete(config.data_prep_output, "data-prep", "finetune-data")
    output = config.finetune_data_output
    directory = StageDirectory(output, replace=config.replace_outputs)
    progress = current_progress() or LogProgress(get_run_logger())
    with directory.lock():
        plan = plan_task(config.finetune_data_prep, output)
        completeness = check_task(directory, plan)
        if completeness.complete:
            progress.note(f"finetune-data: skipped, {output} is up to date ({completeness.reason})")
            return StageResult(**{**skipped(plan, completeness).to_json(), "stage": "finetune-data"}).to_json()
        progress.note(f"finetune-data: running ({completeness.reason})")
        result = tokenize_task(directory, plan)
    return StageResult(**{**result.to_json(), "stage": "finetune-data", "reason": completeness.reason}).to_json()
