"""The convert stage: a checkpoint through a named mapping of `d9d.models.conversions` (no Prefect here)."""

from d9d.flows.jobs.convert.command import add_convert_command, run_convert_command
from d9d.flows.jobs.convert.config import ConvertConfig
from d9d.flows.jobs.convert.stage import (
    STAGE_NAME,
    ConvertPlan,
    commit,
    convert_model,
    plan_convert,
    prepare_source,
    run_convert,
    skipped,
)

__all__ = [
    "STAGE_NAME",
    "ConvertConfig",
    "ConvertPlan",
    "add_convert_command",
    "commit",
    "convert_model",
    "plan_convert",
    "prepare_source",
    "run_convert",
    "run_convert_command",
    "skipped",
]
