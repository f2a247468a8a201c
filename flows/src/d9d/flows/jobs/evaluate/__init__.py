"""The evaluate stage's rank program (no Prefect): `EvaluateConfig`, `run_evaluate`, `write_report`."""

from d9d.flows.jobs.evaluate.program import EvaluateConfig, EvaluationReport, run_evaluate, write_report

__all__ = ["EvaluateConfig", "EvaluationReport", "run_evaluate", "write_report"]
