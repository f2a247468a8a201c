"""The pretrain stage: its section (`PretrainStageConfig`), its rank program's config (`PretrainRankConfig`, run by
`d9d.flows.jobs.pretrain.program`) and the stage itself (`d9d.flows.jobs.pretrain.stage`). No Prefect here."""

from d9d.flows.jobs.pretrain.config import PretrainRankConfig, PretrainStageConfig

__all__ = ["PretrainRankConfig", "PretrainStageConfig"]
