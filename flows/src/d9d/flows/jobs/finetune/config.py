"""Configuration of the fine-tune rank program: the pretrained base, the PEFT method, data and the loop."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.core.dist import MeshDegrees
from d9d.core.loop import TrainerConfig
from d9d.core.lr import AnyLRScheduleConfig, ConstantScheduleConfig
from d9d.core.optim import AdamWConfig, AnyOptimizerConfig
from d9d.flows.jobs.pretrain.config import AnyModelConfig, PretrainDataConfig
from d9d.metrics.trackers import AnyTrackerConfig, NoTrackerConfig
from d9d.parallel import AnyDataParallelConfig, FsdpConfig
from d9d.peft import AnyPeftConfig


class FinetuneValidationConfig(BaseModel):
    """Held-out loss on the fine-tune corpus before and after training (the same batches both times)."""

    model_config = ConfigDict(extra="forbid")

    shards: Path = Field(description="a token-shard set (the fine-tune corpus' validation split)")
    rows_per_step: int = Field(default=8, gt=0, description="rows per step over all data-parallel ranks")
    steps: int = Field(default=4, ge=1)


class FinetuneConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: AnyModelConfig
    base: Path = Field(
        description="the pretrained model: a job checkpoint folder, a directory of them (newest complete), "
        "or a d9d-layout safetensors checkpoint"
    )
    peft: AnyPeftConfig
    data: PretrainDataConfig
    validation: FinetuneValidationConfig | None = None
    trainer: TrainerConfig = Field(
        description="set checkpointing.trainable_only: true to keep job checkpoints to the adapters"
    )
    output: Path = Field(description="merged/ (d9d-layout safetensors), adapter/ and finetune.json go here")
    export_hf_peft: bool = Field(
        default=False, description="also write hf_peft/ (adapter_model.safetensors + adapter_config.json); LoRA only"
    )
    degrees: MeshDegrees = Field(default_factory=lambda: MeshDegrees(dp_shard=-1))
    data_parallel: AnyDataParallelConfig = Field(default_factory=FsdpConfig)
    optimizer: AnyOptimizerConfig = Field(default_factory=AdamWConfig)
    lr_schedule: AnyLRScheduleConfig = Field(default_factory=ConstantScheduleConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tracker: AnyTrackerConfig = Field(
        default_factory=NoTrackerConfig, description="experiment tracker (rank 0 writes), e.g. jsonl or aim"
    )
