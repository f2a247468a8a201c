"""The pipeline flow: every stage in order, each a subflow that skips itself when its manifest says done."""

from __future__ import annotations

from typing import Any

from prefect import flow

from d9d.flows.jobs.stages import PIPELINE
from d9d.flows.stage_flow import JobParameter, job_config, with_retries


@flow(name="pipeline", persist_result=False, validate_parameters=False)
def pipeline_flow(job: JobParameter) -> dict[str, Any]:
    """Run the pipeline's stages in order; a failed stage stops it, and a later run resumes at that stage."""
    config = job_config(job)
    return {"stages": [with_retries(name, config)(config) for name in PIPELINE]}
