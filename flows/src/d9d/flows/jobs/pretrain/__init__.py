"""The pretrain stage's rank program (run under torchrun; no Prefect): `PretrainConfig`, `run_pretrain`."""

from d9d.flows.jobs.pretrain.config import (
    PretrainConfig,
    PretrainDataConfig,
    Qwen3DenseModelConfig,
    Qwen3MoeModelConfig,
)
from d9d.flows.jobs.pretrain.program import run_pretrain

__all__ = ["PretrainConfig", "PretrainDataConfig", "Qwen3DenseModelConfig", "Qwen3MoeModelConfig", "run_pretrain"]
