"""The fine-tune stage's rank program (run under torchrun; no Prefect): `FinetuneConfig` here, `run_finetune` in
`d9d.flows.jobs.finetune.program` (not imported here, so `python -m ...finetune.program` runs it cleanly)."""

from d9d.flows.jobs.finetune.config import FinetuneConfig, FinetuneValidationConfig

__all__ = ["FinetuneConfig", "FinetuneValidationConfig"]
