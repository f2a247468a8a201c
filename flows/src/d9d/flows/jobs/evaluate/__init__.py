"""The evaluate stage: its section (`EvaluateStageConfig`), its rank program (`d9d.flows.jobs.evaluate.program`:
`EvaluateConfig`, `EvaluateSuiteConfig`, `run_evaluate`) and the stage (`d9d.flows.jobs.evaluate.stage`)."""

from d9d.flows.jobs.evaluate.config import EvaluateConfig, EvaluateStageConfig, EvaluateSuiteConfig
from d9d.flows.jobs.evaluate.program import EvaluationReport, run_evaluate, write_report

__all__ = [
    "EvaluateConfig",
    "EvaluateStageConfig",
    "EvaluateSuiteConfig",
    "EvaluationReport",
    "run_evaluate",
    "write_report",
]
