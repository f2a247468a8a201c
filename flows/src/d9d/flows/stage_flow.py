"""One Prefect flow per stage, all built by `stage_flow` from the stage's `StageSpec` (`d9d.flows.jobs.stages`).

Every stage flow does the same: check that the stages it reads from are complete, plan, skip when the manifest
says the output is up to date, else run and commit; then publish the stage's artifacts. Prefect's result cache is
off for every task: the stage's manifest decides whether it is complete, so a deleted or damaged output is redone
whatever Prefect remembers. The flows are reachable by module path (`d9d.flows.stage_flow.<section>_flow`, e.g.
`d9d.flows.stage_flow.convert_flow`), which is how deployments name them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any

from prefect import Flow, flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from d9d.flows.console import current_progress
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import Completeness, StageDirectory, StageResult
from d9d.flows.jobs.launchers import ClusterJob, observe_cluster_jobs
from d9d.flows.jobs.launchers.checks import gpu_slots
from d9d.flows.jobs.progress import LogProgress, Progress
from d9d.flows.jobs.stage_spec import MarkdownArtifact, StagePlan, StageSpec, TableArtifact
from d9d.flows.jobs.stages import STAGES, require_inputs

GPU_LIMIT = "gpus"  # the global concurrency limit `d9d deploy` creates (infra/prefect.yaml): slots = GPUs
# A held slot's lease is renewed while the stage runs; a flow run killed outright (kill -9, a lost node) stops
# renewing, and its slots return to the limit this long after.
GPU_LEASE_SECONDS = 60.0
JobParameter = dict[str, Any] | JobConfig
StageFlow = Flow[[JobParameter], dict[str, Any]]


def job_config(job: JobParameter) -> JobConfig:
    """The job config a flow was given: validated already when the `d9d` command runs the flow in its own process,
    else (a deployment's JSON parameters) validated here, once."""
    return job if isinstance(job, JobConfig) else JobConfig.model_validate(job)


def _progress() -> Progress:
    return current_progress() or LogProgress(get_run_logger())


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
def plan_task(spec: StageSpec[Any], config: JobConfig) -> StagePlan:
    require_inputs(config, spec)
    plan: StagePlan = spec.plan(config, _progress())
    return plan


@task(name="check-manifest", cache_policy=NO_CACHE, persist_result=False)
def check_task(spec: StageSpec[Any], directory: StageDirectory, plan: StagePlan) -> Completeness:
    return spec.check(directory, plan)


@task(name="run", cache_policy=NO_CACHE, persist_result=False)
def run_task(spec: StageSpec[Any], directory: StageDirectory, plan: StagePlan) -> StageResult:
    return spec.run(plan, directory, _progress())


@task(name="publish", cache_policy=NO_CACHE, persist_result=False)
def publish_task(spec: StageSpec[Any], result: StageResult) -> None:
    """The stage's artifacts on the flow run's page."""
    for artifact in spec.artifacts(result):
        match artifact:
            case MarkdownArtifact():
                create_markdown_artifact(artifact.markdown, key=artifact.key, description=artifact.description)
            case TableArtifact():
                create_table_artifact(artifact.rows, key=artifact.key, description=artifact.description)


@contextmanager
def gpu_slots_held(spec: StageSpec[Any], slots: int) -> Iterator[None]:
    """Hold `slots` of the `gpus` limit while the block runs (waits until they are free; none for a CPU stage).
    Without that limit on the Prefect server (a plain `d9d run`) nothing is held."""
    if slots <= 0:
        yield
        return
    from prefect.concurrency.sync import concurrency

    progress = _progress()
    progress.note(f"{spec.name}: waiting for {slots} slot(s) of the {GPU_LIMIT!r} concurrency limit")
    with concurrency(GPU_LIMIT, occupy=slots, lease_duration=GPU_LEASE_SECONDS, strict=False):
        progress.note(f"{spec.name}: holds {slots} slot(s) of {GPU_LIMIT!r}")
        yield


def publish_cluster_job(spec: StageSpec[Any]) -> AbstractContextManager[None]:
    """An artifact on the run's page for the stage's cluster job: id, state, nodes, log (updated as it changes)."""

    def publish(job: ClusterJob) -> None:
        create_table_artifact(
            job.rows(),
            key=f"{spec.name}-cluster-job",
            description=f"{spec.name}: {job.scheduler} job {job.job_id}, {job.state}",
        )

    return observe_cluster_jobs(publish)


def run_stage(spec: StageSpec[Any], config: JobConfig) -> StageResult:
    """The body of every stage flow."""
    # A stage replaces only what it wrote itself, unless the job says `replace_outputs` (see the stage contract).
    directory = StageDirectory(spec.output(config), replace=config.replace_outputs)
    progress = _progress()
    with directory.lock():
        plan = plan_task(spec, config)
        completeness = check_task(spec, directory, plan)
        if completeness.complete:
            progress.note(f"{spec.name}: skipped, {plan.output} is up to date ({completeness.reason})")
            result = spec.skipped(plan, completeness)
        else:
            progress.note(f"{spec.name}: {spec.describe(plan)} ({completeness.reason})")
            slots = gpu_slots(getattr(config, spec.section))
            with gpu_slots_held(spec, slots), publish_cluster_job(spec):
                result = run_task(spec, directory, plan).with_reason(completeness.reason)
    result = replace(result, stage=spec.name)  # finetune-data reports as itself, not as the data-prep code it runs
    if spec.publishes:
        publish_task(spec, result)
    return result


def stage_flow(spec: StageSpec[Any]) -> StageFlow:
    """The Prefect flow of `spec`, named after the stage."""

    def body(job: JobParameter) -> dict[str, Any]:
        return run_stage(spec, job_config(job)).to_json()

    body.__name__ = body.__qualname__ = f"{spec.section}_flow"
    body.__doc__ = spec.summary
    return flow(name=spec.name, persist_result=False, validate_parameters=False)(body)


FLOWS: dict[str, StageFlow] = {name: stage_flow(spec) for name, spec in STAGES.items()}
_BY_ATTRIBUTE = {stage.fn.__name__: stage for stage in FLOWS.values()}


def with_retries(name: str, config: JobConfig) -> StageFlow:
    """Stage `name`'s flow with the retries its config section asks for."""
    retries, delay = STAGES[name].retries(config)
    return FLOWS[name].with_options(retries=retries, retry_delay_seconds=delay)


def __getattr__(name: str) -> StageFlow:
    # Deployments import a flow by module path (`d9d.flows.stage_flow.convert_flow`).
    try:
        return _BY_ATTRIBUTE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
