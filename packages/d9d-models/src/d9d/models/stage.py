"""Pipeline-stage awareness lives in d9d-pipeline; re-exported here for the models' imports."""

from d9d.pipeline.stage import SINGLE_STAGE, PipelineStage

__all__ = ["SINGLE_STAGE", "PipelineStage"]
