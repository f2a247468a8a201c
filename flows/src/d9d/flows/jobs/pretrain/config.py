"""Configuration of the pretrain rank program: model, parallelism, data, optimizer, schedule and the loop."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.core.dist import MeshDegrees
from d9d.core.loop import TrainerConfig
from d9d.core.lr import AnyLRScheduleConfig, ConstantScheduleConfig
from d9d.core.optim import AdamWConfig, AnyOptimizerConfig
from d9d.metrics.trackers import AnyTrackerConfig, NoTrackerConfig
from d9d.models import DecoderConfig
from d9d.models.qwen3 import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.parallel import AnyDataParallelConfig, FsdpConfig


class Qwen3DenseModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["qwen3_dense"] = "qwen3_dense"
    parameters: Qwen3DenseParameters
    decoder: DecoderConfig = Field(default_factory=DecoderConfig)


class Qwen3MoeModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["qwen3_moe"] = "qwen3_moe"
    parameters: Qwen3MoeParameters
    decoder: DecoderConfig = Field(default_factory=DecoderConfig)
    expert_bias_rate: float = Field(default=1e-3, ge=0, description="aux-loss-free balancing step (router_expert_bias)")


AnyModelConfig = Annotated[Qwen3DenseModelConfig | Qwen3MoeModelConfig, Field(discriminator="kind")]


class PretrainDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shards: Path = Field(description="a token-shard set (the data-prep stage's train split)")
    seq_len: int = Field(gt=0)
    shuffle_seed: int = 0


class PretrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: AnyModelConfig
    data: PretrainDataConfig
    trainer: TrainerConfig
    degrees: MeshDegrees = Field(default_factory=lambda: MeshDegrees(dp_shard=-1))
    data_parallel: AnyDataParallelConfig = Field(default_factory=FsdpConfig)
    optimizer: AnyOptimizerConfig = Field(default_factory=AdamWConfig)
    lr_schedule: AnyLRScheduleConfig = Field(default_factory=ConstantScheduleConfig)
    init_from: Path | None = Field(default=None, description="a d9d-layout safetensors checkpoint to start from")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tracker: AnyTrackerConfig = Field(
        default_factory=NoTrackerConfig, description="experiment tracker (rank 0 writes), e.g. jsonl or aim"
    )
