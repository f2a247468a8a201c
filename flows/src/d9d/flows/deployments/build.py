"""A deployment entry to a Prefect `RunnerDeployment`: the flow by name, the job config resolved, cron schedules.

Entrypoints are module paths (`d9d.flows.stage_flow.convert_flow`), so a worker or runner imports the flow
from the installed d9d-flows: nothing is pulled from storage or built into an image at deploy time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from d9d.flows.deployments.config import DeployConfigError, DeploymentConfig
from d9d.flows.jobs.loading import JobConfigError, load_job_config

if TYPE_CHECKING:
    from prefect import Flow
    from prefect.deployments.runner import RunnerDeployment


def flow_named(name: str) -> Flow[[Any], dict[str, Any]]:
    """The pipeline flow or a stage's flow by its command-line name."""
    from d9d.flows.pipeline import pipeline_flow
    from d9d.flows.stage_flow import FLOWS

    if name == "pipeline":
        return pipeline_flow
    if name in FLOWS:
        return FLOWS[name]
    raise DeployConfigError(f"flow = {name!r} is not a d9d flow; valid: pipeline, {', '.join(FLOWS)}")


def job_parameters(deployment: DeploymentConfig) -> dict[str, Any]:
    """The `job` parameter every run of the deployment gets: the job config built like `d9d run` builds it."""
    source = deployment.job
    try:
        config = load_job_config(preset_name=source.preset, config_file=source.config, overrides=source.set)
    except JobConfigError as error:
        raise DeployConfigError(f"deployment {deployment.name!r}: {error}") from error
    return {"job": config.model_dump(mode="json")}


def runner_deployment(deployment: DeploymentConfig, *, with_work_pool: bool) -> RunnerDeployment:
    """The Prefect deployment for one entry; `with_work_pool=False` for `d9d serve` (the runner runs it)."""
    from prefect.deployments.runner import RunnerDeployment
    from prefect.schedules import Cron
    from prefect.types.entrypoint import EntrypointType

    try:
        flow = flow_named(deployment.flow)
    except DeployConfigError as error:
        raise DeployConfigError(f"deployment {deployment.name!r}: {error}") from error
    pool = deployment.work_pool if with_work_pool else None
    if with_work_pool and pool is None:
        raise DeployConfigError(
            f"deployment {deployment.name!r} has no work_pool; `d9d deploy` puts every deployment on a work pool "
            "(add `work_pool: {name: local}`), or serve it with `d9d serve`"
        )
    runner = flow.to_deployment(
        name=deployment.name,
        schedules=[Cron(item.cron, timezone=item.timezone, active=item.active) for item in deployment.schedules],
        parameters=job_parameters(deployment),
        concurrency_limit=deployment.concurrency_limit,
        tags=list(deployment.tags),
        description=deployment.description,
        paused=deployment.paused,
        work_pool_name=pool.name if pool else None,
        work_queue_name=pool.work_queue_name if pool else None,
        job_variables=dict(pool.job_variables) if pool else None,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    assert isinstance(runner, RunnerDeployment)  # sync context: not the awaitable of the async-compatible API
    return runner
