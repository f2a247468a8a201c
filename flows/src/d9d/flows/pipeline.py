"""The pipeline flow: every stage in order, each a subflow that skips itself when its manifest says done."""

from __future__ import annotations

from typing import Any

from prefect import flow

from d9d.flows.jobs.config import JobConfig
from d9d.flows.stages import PIPELINE, STAGES


@flow(name="pipeline", persist_result=False, validate_parameters=False)
def pipeline_flow(job: dict[str, Any]) -> dict[str, Any]:
    """Run the pipeline's stages in order; a failed stage stops it, and a later run resumes at that stage."""
    config = JobConfig.model_validate(job)
    results = [STAGES[name].with_retries(config)(job) for name in PIPELINE]
    return {"stages": results}
