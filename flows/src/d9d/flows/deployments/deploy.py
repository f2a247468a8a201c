"""`d9d deploy`: apply a deployment file through Prefect's API (work pools, concurrency limits, deployments).

No network beyond the Prefect API: process work pools are created here with the process worker's default base job
template (so `prefect work-pool create` never has to fetch it), and deployments point at module entrypoints of the
installed d9d-flows (no code storage). Everything in the file is validated, and every referenced work pool checked,
before the first change is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import UUID

from d9d.flows.deployments.build import runner_deployment
from d9d.flows.deployments.config import DeployConfigError, DeployFile, WorkPoolConfig

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient


@dataclass(frozen=True, kw_only=True)
class AppliedDeployment:
    full_name: str  # FLOW/DEPLOYMENT, as `prefect deployment run` and `run_deployment` take it
    id: UUID
    work_pool: str
    schedules: tuple[str, ...]


@dataclass(kw_only=True)
class DeployReport:
    work_pools: list[str] = field(default_factory=list)
    concurrency_limits: list[str] = field(default_factory=list)
    deployments: list[AppliedDeployment] = field(default_factory=list)

    def lines(self) -> list[str]:
        lines = [f"work pool {line}" for line in self.work_pools]
        lines += [f"concurrency limit {line}" for line in self.concurrency_limits]
        for applied in self.deployments:
            when = ", ".join(applied.schedules) or "no schedule (run it with `prefect deployment run`)"
            lines.append(f"deployment {applied.full_name} on pool {applied.work_pool}: {when}")
        return lines


def process_job_template(pool: WorkPoolConfig) -> dict[str, Any]:
    """The process worker's default base job template with the pool's `job_variables` as the new defaults."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    properties: dict[str, Any] = template["variables"]["properties"]
    for key, value in pool.job_variables.items():
        if key not in properties:
            raise DeployConfigError(
                f"work pool {pool.name!r}: job_variables.{key} is not a process-pool variable; "
                f"valid: {', '.join(sorted(properties))}"
            )
        properties[key]["default"] = value
    return template


def apply_deploy_file(deploy_file: DeployFile, names: list[str]) -> DeployReport:
    """Create or update the file's work pools and limits, then its deployments (all, or those named)."""
    from prefect.client.orchestration import get_client

    selected = deploy_file.select(names)
    deployments = [runner_deployment(entry, with_work_pool=True) for entry in selected]
    templates = {pool.name: process_job_template(pool) for pool in deploy_file.work_pools}
    report = DeployReport()
    with get_client(sync_client=True) as client:
        _check_pools_exist(client, deploy_file, {str(entry.work_pool.name) for entry in selected if entry.work_pool})
        for pool in deploy_file.work_pools:
            report.work_pools.append(_ensure_work_pool(client, pool, templates[pool.name]))
        for limit in deploy_file.concurrency_limits:
            client.upsert_global_concurrency_limit_by_name(limit.name, limit.limit)
            report.concurrency_limits.append(f"{limit.name}: {limit.limit} slots")
    for entry, deployment in zip(selected, deployments, strict=True):
        deployment_id = deployment.apply()
        assert isinstance(deployment_id, UUID)  # sync context: not the awaitable of the async-compatible API
        report.deployments.append(
            AppliedDeployment(
                full_name=f"{deployment.flow_name}/{deployment.name}",
                id=deployment_id,
                work_pool=entry.work_pool.name if entry.work_pool else "",
                schedules=tuple(f"cron {item.cron!r} ({item.timezone})" for item in entry.schedules),
            )
        )
    return report


def _check_pools_exist(client: SyncPrefectClient, deploy_file: DeployFile, referenced: set[str]) -> None:
    from prefect.exceptions import ObjectNotFound

    declared = {pool.name for pool in deploy_file.work_pools}
    for name in sorted(referenced - declared):
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            raise DeployConfigError(
                f"work_pool.name = {name!r}: no such work pool on the server and none declared under work_pools; "
                f"declared: {', '.join(sorted(declared)) or 'none'}"
            ) from None


def _ensure_work_pool(client: SyncPrefectClient, pool: WorkPoolConfig, template: dict[str, Any]) -> str:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    try:
        existing = client.read_work_pool(pool.name)
    except ObjectNotFound:
        existing = None
    if existing is not None and existing.type != pool.type:
        raise DeployConfigError(
            f"work pool {pool.name!r} exists with type {existing.type!r}, but the file declares type {pool.type!r}; "
            "rename one of them"
        )
    client.create_work_pool(
        WorkPoolCreate(
            name=pool.name,
            type=pool.type,
            description=pool.description,
            base_job_template=template,
            concurrency_limit=pool.concurrency_limit,
        ),
        overwrite=existing is not None,
    )
    limit = pool.concurrency_limit if pool.concurrency_limit is not None else "unlimited"
    return f"{pool.name} ({pool.type}, {'updated' if existing else 'created'}; concurrency {limit})"
