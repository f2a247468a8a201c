"""The stages of a job, in the order the pipeline runs them: the one registration of each stage's `StageSpec`."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import ManifestError, StageDirectory, StageManifest
from d9d.flows.jobs.convert.stage import SPEC as CONVERT
from d9d.flows.jobs.data_prep.stage import SPEC as DATA_PREP
from d9d.flows.jobs.evaluate.stage import SPEC as EVALUATE
from d9d.flows.jobs.finetune.data import SPEC as FINETUNE_DATA
from d9d.flows.jobs.finetune.stage import SPEC as FINETUNE
from d9d.flows.jobs.launchers.checks import check_launcher
from d9d.flows.jobs.pretrain.stage import SPEC as PRETRAIN
from d9d.flows.jobs.stage_spec import PreflightError, StageSpec

PIPELINE_SPECS: tuple[StageSpec[Any], ...] = (DATA_PREP, FINETUNE_DATA, CONVERT, PRETRAIN, FINETUNE, EVALUATE)
STAGES: dict[str, StageSpec[Any]] = {spec.name: spec for spec in PIPELINE_SPECS}
PIPELINE: tuple[str, ...] = tuple(STAGES)


class MissingInputError(PreflightError):
    """A stage's input is not a complete stage output (names the stage to run first)."""


def require_inputs(config: JobConfig, spec: StageSpec[Any], running: Collection[str] = ()) -> None:
    """The outputs `spec` reads must be complete, unless a stage running before it in this run writes them."""
    for earlier, output in spec.reads(config).items():
        if earlier in running:
            continue
        try:
            StageManifest.read(output)
        except ManifestError as error:
            raise MissingInputError(
                f"{spec.name} reads the output of {earlier} at {output}, which is not complete ({error}); "
                f"run `d9d run {earlier}` (or the pipeline) first"
            ) from error


def preflight(config: JobConfig, names: Sequence[str]) -> None:
    """Every check that can fail before anything starts, for the stages `names` run in this order."""
    for index, name in enumerate(names):
        spec = STAGES[name]
        # Refuses a stage output that would replace what the stage did not write (unless `replace_outputs`).
        StageDirectory(spec.output(config), replace=config.replace_outputs).refuse_foreign()
        spec.preflight(config)
        check_launcher(spec.section, getattr(config, spec.section), spec.output(config))
        require_inputs(config, spec, running=names[:index])
