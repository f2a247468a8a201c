"""`StageSpec`: everything the command line, the preflight and the generic Prefect flow need to know of one stage.

A stage module ends with its `SPEC`; `d9d.flows.jobs.stages` lists them in pipeline order. Nothing else names a
stage: the `d9d run` targets, the preflight loop, the "run that stage first" check, the pipeline and the Prefect
flow (`d9d.flows.stage_flow`) are all built from these values. No Prefect here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from d9d.flows.jobs.contract import Completeness, StageDirectory, StageResult
from d9d.flows.jobs.progress import Progress

if TYPE_CHECKING:
    from d9d.flows.jobs.config import JobConfig
    from d9d.flows.jobs.contract import StageKey


class PreflightError(ValueError):
    """A stage section cannot run as configured; the message names the fields, their values and a fix."""


class StagePlan(Protocol):
    """What every stage's plan has: its output directory and the key its manifest is checked against."""

    @property
    def output(self) -> Path: ...

    @property
    def key(self) -> StageKey: ...


PlanT = TypeVar("PlanT", bound=StagePlan)


@dataclass(frozen=True, kw_only=True)
class MarkdownArtifact:
    key: str
    markdown: str
    description: str


@dataclass(frozen=True, kw_only=True)
class TableArtifact:
    key: str
    rows: list[dict[str, Any]]
    description: str


Artifact = MarkdownArtifact | TableArtifact


def _no_preflight(config: JobConfig) -> None:
    del config


def _manifest_check(directory: StageDirectory, plan: StagePlan) -> Completeness:
    return directory.check(plan.key)


def _no_artifacts(result: StageResult) -> Sequence[Artifact]:
    del result
    return ()


@dataclass(frozen=True, kw_only=True)
class StageSpec(Generic[PlanT]):
    """One stage.

    - `name`: its `d9d run` target and Prefect flow name; `section`: the `JobConfig` field holding its config.
    - `reads(config)`: the stages whose outputs it reads, `{stage name: output path}` (the dependency graph).
    - `output(config)`: where it commits.
    - `preflight(config)`: checks that can fail before anything starts (names field, value and fix).
    - `plan(config, progress)`: its inputs fingerprinted into a key; `describe(plan)`: the "running ..." line.
    - `run(plan, directory, progress)`: do the work in the directory's partial directory and commit it.
    - `check(directory, plan)`: whether the output is complete for the plan's key (default: its manifest).
    - `skipped(plan, completeness)`: the result when the manifest says it is complete.
    - `artifacts(result)`: what the Prefect flow publishes on its run page (plain data).
    """

    name: str
    section: str
    summary: str
    reads: Callable[[JobConfig], Mapping[str, Path]]
    output: Callable[[JobConfig], Path]
    plan: Callable[[JobConfig, Progress], PlanT]
    run: Callable[[PlanT, StageDirectory, Progress], StageResult]
    skipped: Callable[[PlanT, Completeness], StageResult]
    describe: Callable[[PlanT], str] = field(default=lambda plan: "running")
    preflight: Callable[[JobConfig], None] = _no_preflight
    check: Callable[[StageDirectory, PlanT], Completeness] = _manifest_check
    artifacts: Callable[[StageResult], Sequence[Artifact]] = _no_artifacts

    @property
    def publishes(self) -> bool:
        return self.artifacts is not _no_artifacts

    def retries(self, config: JobConfig) -> tuple[int, float]:
        """(retries, delay in seconds) from the stage's config section."""
        section = getattr(config, self.section)
        return int(section.retries), float(section.retry_delay_seconds)
