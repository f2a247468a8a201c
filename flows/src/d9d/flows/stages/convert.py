"""The convert stage as a Prefect flow: source, plan, skip if the manifest says done, convert, commit.

The job's `convert` section is a `ConvertConfig`; its output defaults to `<workdir>/model`. Without a source, the
random checkpoint it converts has the pretrain section's architecture, so pretraining starts from its output.
Prefect's result cache is off: the stage's manifest decides whether it is complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from d9d.flows.console import current_progress
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import Completeness, StageDirectory, StageResult
from d9d.flows.jobs.convert import (
    ConvertConfig,
    ConvertPlan,
    commit,
    plan_convert,
    prepare_source,
    run_convert,
    skipped,
)
from d9d.flows.jobs.progress import LogProgress, Progress
from d9d.models.qwen3 import Qwen3DenseParameters


def _progress() -> Progress:
    return current_progress() or LogProgress(get_run_logger())


@task(name="source", cache_policy=NO_CACHE, persist_result=False)
def source_task(config: ConvertConfig, output: Path, architecture: Qwen3DenseParameters) -> Path:
    return prepare_source(config, output, _progress(), architecture=architecture)


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
def plan_task(config: ConvertConfig, output: Path, source: Path, architecture: Qwen3DenseParameters) -> ConvertPlan:
    return plan_convert(config, output, source, architecture=architecture)


@task(name="check-manifest", cache_policy=NO_CACHE, persist_result=False)
def check_task(directory: StageDirectory, plan: ConvertPlan) -> Completeness:
    return directory.check(plan.key)


@task(name="convert", cache_policy=NO_CACHE, persist_result=False)
def convert_task(directory: StageDirectory, plan: ConvertPlan) -> StageResult:
    partial = directory.open_partial(plan.key)
    files, statistics = run_convert(plan, partial)
    return commit(directory, partial, plan, files, statistics)


@flow(name="convert", persist_result=False, validate_parameters=False)
def convert_flow(job: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint through a named mapping into `<workdir>/model` (a random HF checkpoint of the pretrain
    section's architecture when no source is set)."""
    job_config = JobConfig.model_validate(job)
    config, output = job_config.convert, job_config.convert_output
    architecture = job_config.pretrain.model.parameters
    directory = StageDirectory(output, replace=job_config.replace_outputs)
    progress = _progress()
    with directory.lock():
        source = source_task(config, output, architecture)
        plan = plan_task(config, output, source, architecture)
        completeness = check_task(directory, plan)
        if completeness.complete:
            progress.note(f"convert: skipped, {output} is up to date ({completeness.reason})")
            return skipped(plan, completeness).to_json()
        progress.note(f"convert: running {plan.mapping} on {source} ({completeness.reason})")
        result = convert_task(directory, plan)
    return result.with_reason(completeness.reason).to_json()
