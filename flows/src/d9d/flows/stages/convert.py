"""The convert stage as a Prefect flow: source, plan, skip if the manifest says done, convert, commit.

The job's `convert` section is a `ConvertConfig`; its output defaults to `<workdir>/model`. Prefect's result cache
is off: the stage's manifest decides whether it is complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from d9d.flows.console import current_progress
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


def _progress() -> Progress:
    return current_progress() or LogProgress(get_run_logger())


def convert_section(job: dict[str, Any]) -> tuple[ConvertConfig, Path]:
    """The stage's config and absolute output directory from a job dict (`workdir` and the `convert` section)."""
    config = ConvertConfig.model_validate(job.get("convert") or {})
    workdir = Path(job.get("workdir", "runs/default")).resolve()
    output = config.output.resolve() if config.output is not None else workdir / "model"
    return config, output


@task(name="source", cache_policy=NO_CACHE, persist_result=False)
def source_task(config: ConvertConfig, output: Path) -> Path:
    return prepare_source(config, output, _progress())


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
def plan_task(config: ConvertConfig, output: Path, source: Path) -> ConvertPlan:
    return plan_convert(config, output, source)


@task(name="check-manifest", cache_policy=NO_CACHE, persist_result=False)
def check_task(directory: StageDirectory, plan: ConvertPlan) -> Completeness:
    return directory.check(plan.key)


@task(name="convert", cache_policy=NO_CACHE, persist_result=False)
def convert_task(directory: StageDirectory, plan: ConvertPlan) -> StageResult:
    partial = directory.open_partial()
    files, statistics = run_convert(plan, partial)
    return commit(directory, partial, plan, files, statistics)


@flow(name="convert", persist_result=False, validate_parameters=False)
def convert_flow(job: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint through a named mapping into `<workdir>/model` (a random HF checkpoint when no source is set)."""
    config, output = convert_section(job)
    directory = StageDirectory(output)
    progress = _progress()
    with directory.lock():
        source = source_task(config, output)
        plan = plan_task(config, output, source)
        completeness = check_task(directory, plan)
        if completeness.complete:
            progress.note(f"convert: skipped, {output} is up to date ({completeness.reason})")
            return skipped(plan, completeness).to_json()
        progress.note(f"convert: running {config.mapping} on {source} ({completeness.reason})")
        result = convert_task(directory, plan)
    return StageResult(**{**result.to_json(), "reason": completeness.reason}).to_json()
