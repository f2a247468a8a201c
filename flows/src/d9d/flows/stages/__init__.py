"""One Prefect flow per stage, keyed by the stage names of `d9d.flows.jobs.stage_names`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import Flow

from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.stage_names import PIPELINE, STAGE_SECTIONS
from d9d.flows.stages.convert import convert_flow
from d9d.flows.stages.data_prep import data_prep_flow
from d9d.flows.stages.evaluate import evaluate_flow
from d9d.flows.stages.finetune import finetune_flow
from d9d.flows.stages.finetune_data import finetune_data_flow
from d9d.flows.stages.pretrain import pretrain_flow


@dataclass(frozen=True, kw_only=True)
class Stage:
    name: str
    flow: Flow[[dict[str, Any]], dict[str, Any]]

    def with_retries(self, config: JobConfig) -> Flow[[dict[str, Any]], dict[str, Any]]:
        """The stage's flow with the retries its config section asks for."""
        section = getattr(config, STAGE_SECTIONS[self.name])
        return self.flow.with_options(retries=section.retries, retry_delay_seconds=section.retry_delay_seconds)


STAGES: dict[str, Stage] = {
    "data-prep": Stage(name="data-prep", flow=data_prep_flow),
    "finetune-data": Stage(name="finetune-data", flow=finetune_data_flow),
    "convert": Stage(name="convert", flow=convert_flow),
    "pretrain": Stage(name="pretrain", flow=pretrain_flow),
    "finetune": Stage(name="finetune", flow=finetune_flow),
    "evaluate": Stage(name="evaluate", flow=evaluate_flow),
}
assert set(STAGES) == set(STAGE_SECTIONS), "every stage name needs a flow"

__all__ = ["PIPELINE", "STAGES", "Stage"]
