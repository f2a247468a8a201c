"""The fine-tune stage: its section (`FinetuneStageConfig`), its rank program's config (`FinetuneRankConfig`, run by
`d9d.flows.jobs.finetune.program`, not imported here so `python -m ...finetune.program` runs it cleanly) and the
stage itself (`d9d.flows.jobs.finetune.stage`). No Prefect here."""

from d9d.flows.jobs.finetune.config import FinetuneRankConfig, FinetuneStageConfig

__all__ = ["FinetuneRankConfig", "FinetuneStageConfig"]
