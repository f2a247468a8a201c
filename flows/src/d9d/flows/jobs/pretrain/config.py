"""The `pretrain` section of a job and the pretrain rank program's config, which embeds that section unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.flows.jobs.torchrun_stage import TrainingStageConfig
from d9d.metrics.trackers import AnyTrackerConfig, NoTrackerConfig
from d9d.models.catalogue import AnyModelConfig, Qwen3DenseModelConfig
from d9d.models.qwen3 import Qwen3DenseParameters

DEFAULT_MODEL = Qwen3DenseModelConfig(
    parameters=Qwen3DenseParameters(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )
)  # fmt: skip


class PretrainStageConfig(TrainingStageConfig):
    """The `pretrain` section of a job: the model and how long and how wide to train it.

    `init_from="convert"` starts from the convert stage's checkpoint when its parameters equal `model.parameters`
    (same family and shapes); otherwise, and with `"random"`, the model starts from its seeded initialisation.
    The stage records which one it used.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: AnyModelConfig = Field(default=DEFAULT_MODEL)
    seq_len: int = Field(default=128, gt=0, description="tokens per packed row")
    init_from: Literal["convert", "random"] = "convert"


class PretrainRankConfig(BaseModel):
    """What every pretrain rank reads (`job.yaml`): the job's `pretrain` section as the user set it, and where this
    run reads and writes (resolved by the stage)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: PretrainStageConfig
    train_shards: Path = Field(description="a token-shard set (the data-prep stage's train split)")
    checkpoints: Path = Field(description="job checkpoints go here; the newest complete one is resumed")
    init_weights: Path | None = Field(default=None, description="a d9d-layout safetensors checkpoint to start from")
    model_output: Path | None = Field(
        default=None, description="the trained model, written here as d9d-layout safetensors with parameters.json"
    )
    tracker: AnyTrackerConfig = Field(
        default_factory=NoTrackerConfig, description="experiment tracker (rank 0 writes), e.g. jsonl or aim"
    )
