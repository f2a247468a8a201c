"""The deployment file (`infra/prefect.yaml`): work pools, concurrency limits and scheduled deployments of d9d flows.

Its deployment entries have the shape of Prefect's own `prefect.yaml` where the meaning is the same (`name`,
`work_pool`, `schedules`, `concurrency_limit`, `tags`, `description`); d9d adds `flow` (a stage name or `pipeline`)
and `job` (the job config as `d9d run` builds it: preset, YAML file, `--set` overrides). `d9d deploy` applies it
through Prefect's API (no code is pulled or pushed: the flows are imported from the installed d9d-flows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from d9d.core.config import read_config_file

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class DeployConfigError(ValueError):
    """The deployment file is invalid; the message names the key, the value and what would be valid."""


class ScheduleConfig(BaseModel):
    """A cron schedule (Prefect's `schedules` entry), checked by Prefect's own schedule model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cron: str = Field(description="five-field cron, e.g. '0 2 * * *' (02:00 every day)")
    timezone: str = "UTC"
    active: bool = True

    @model_validator(mode="after")
    def _valid_cron_and_timezone(self) -> ScheduleConfig:
        # Prefect's own schedule model is the authority on what its scheduler accepts (cron syntax, IANA zones).
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=self.cron, timezone=self.timezone)
        except ValidationError as error:
            reasons = "; ".join(problem["msg"] for problem in error.errors(include_url=False))
            raise ValueError(
                f"cron={self.cron!r} timezone={self.timezone!r} is not a valid schedule ({reasons}); "
                "use five fields 'minute hour day-of-month month day-of-week', e.g. '0 2 * * *', "
                "and an IANA timezone such as 'UTC' or 'Europe/Berlin'"
            ) from None
        return self


class JobSource(BaseModel):
    """How the deployment's job config is built, exactly as `d9d run --preset P --config F --set K=V` builds it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str | None = None
    config: Path | None = Field(default=None, description="a YAML job file (relative: to the current directory)")
    set: tuple[str, ...] = Field(default=(), description="KEY=VALUE overrides applied in order")


class WorkPoolRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    work_queue_name: str | None = None
    job_variables: dict[str, Any] = Field(default_factory=dict)


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    flow: str = Field(description="'pipeline' or a stage name (data-prep, convert, ...)")
    job: JobSource = Field(default_factory=JobSource)
    schedules: tuple[ScheduleConfig, ...] = ()
    work_pool: WorkPoolRef | None = Field(default=None, description="`d9d deploy` needs one; `d9d serve` ignores it")
    concurrency_limit: int | None = Field(default=None, ge=1, description="runs of this deployment at once")
    tags: tuple[str, ...] = ()
    description: str | None = None
    paused: bool = False


class WorkPoolConfig(BaseModel):
    """A work pool `d9d deploy` creates if missing (and updates: concurrency limit, base job template)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    type: Literal["process"] = Field(
        default="process",
        description="process: created here; other types (kubernetes, slurm) need their worker package and are "
        "created with `prefect work-pool create --type ... --base-job-template infra/work-pools/...`",
    )
    concurrency_limit: int | None = Field(default=None, ge=1, description="flow runs of this pool at once")
    job_variables: dict[str, Any] = Field(
        default_factory=dict, description="defaults for the pool's base job template (e.g. env, working_dir)"
    )
    description: str | None = None


class GlobalLimitConfig(BaseModel):
    """A Prefect global concurrency limit, e.g. `gpus` (slots = GPUs) that training flows occupy while they run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    limit: int = Field(ge=1)


class DeployFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    work_pools: tuple[WorkPoolConfig, ...] = ()
    concurrency_limits: tuple[GlobalLimitConfig, ...] = ()
    deployments: tuple[DeploymentConfig, ...] = ()

    @field_validator("deployments")
    @classmethod
    def _unique_names(cls, deployments: tuple[DeploymentConfig, ...]) -> tuple[DeploymentConfig, ...]:
        seen: set[tuple[str, str]] = set()
        for deployment in deployments:
            key = (deployment.flow, deployment.name)
            if key in seen:
                raise ValueError(f"deployment {deployment.flow}/{deployment.name} appears twice; names must differ")
            seen.add(key)
        return deployments

    def select(self, names: list[str]) -> tuple[DeploymentConfig, ...]:
        """The deployments named (all when `names` is empty); an unknown name is an error listing the known ones."""
        if not names:
            return self.deployments
        known = {deployment.name for deployment in self.deployments}
        unknown = [name for name in names if name not in known]
        if unknown:
            missing = ", ".join(map(repr, unknown))
            raise DeployConfigError(
                f"no deployment named {missing} in the file; deployments: {', '.join(sorted(known))}"
            )
        return tuple(deployment for deployment in self.deployments if deployment.name in names)


def load_deploy_file(path: Path) -> DeployFile:
    """The validated deployment file; every problem is reported as `key.path = value: what is wrong`."""
    try:
        data = read_config_file(path)
    except FileNotFoundError as error:
        raise DeployConfigError(f"deployment file {path} does not exist") from error
    except (OSError, ValueError) as error:
        raise DeployConfigError(f"deployment file {path} is unreadable: {error}") from error
    try:
        return DeployFile.model_validate(data)
    except ValidationError as error:
        lines = [f"invalid deployment file {path}:"]
        for problem in error.errors(include_url=False):
            location = ".".join(str(part) for part in problem["loc"]) or "(top level)"
            given = problem.get("input")
            shown = "" if problem["type"] == "missing" or isinstance(given, dict) else f" = {given!r}"
            lines.append(f"  {location}{shown}: {problem['msg']}")
        raise DeployConfigError("\n".join(lines)) from error
