"""The `finetune` section of a job and the fine-tune rank program's config, which embeds that section unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from d9d.core.optim import AdamWConfig, AnyOptimizerConfig
from d9d.flows.jobs.torchrun_stage import TrainingStageConfig
from d9d.metrics.trackers import AnyTrackerConfig, NoTrackerConfig
from d9d.models.catalogue import AnyModelConfig
from d9d.models.conversions import NAMED_MAPPINGS
from d9d.peft import AnyPeftConfig
from d9d.peft.config import LoRAConfig, LoRAParameters

# LoRA on every attention and MLP projection of the Qwen3 blocks (dense MLPs and grouped experts alike).
DEFAULT_PEFT = LoRAConfig.model_validate(
    {
        "module_name_pattern": r".*\.self_attn\.(q|k|v|o)_proj|.*\.mlp\.(experts\.)?(gate|up|down)_proj",
        "params": LoRAParameters(r=8, alpha=16.0),
    }
)


class FinetuneStageConfig(TrainingStageConfig):
    """The `finetune` section of a job: the base, the PEFT method, and how long and how wide to train it.

    `base` unset: the pretrain stage's newest job checkpoint, with the pretrain section's model. `base` set: a
    safetensors checkpoint directory (d9d layout with its `parameters.json`, or, with `base_mapping`, any layout a
    named conversion reads, e.g. a Hugging Face Qwen3 directory with `base_mapping: qwen3-hf-to-d9d`); the model is
    the one that checkpoint describes, and the pretrain stage is not needed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: Path | None = Field(default=None, description="None: the pretrain stage's newest checkpoint")
    base_mapping: str | None = Field(
        default=None, description="a `d9d convert --list` name that reads `base` into d9d's layout (None: d9d layout)"
    )
    peft: AnyPeftConfig = Field(default=DEFAULT_PEFT, description="LoRA (default), full_tune, or a stack of them")
    steps: int = Field(default=50, ge=1)
    checkpoint_every: int | None = Field(default=25, ge=1, description="None: at the end and on SIGTERM only")
    optimizer: AnyOptimizerConfig = Field(default_factory=lambda: AdamWConfig(lr=1e-3))
    validation_rows_per_step: int = Field(default=8, gt=0, description="finetune.json's before/after loss")
    validation_steps: int = Field(default=4, ge=1)
    export_hf_peft: bool = Field(
        default=False, description="also write hf_peft/ (adapter_model.safetensors + adapter_config.json); LoRA only"
    )

    @field_validator("peft", mode="before")
    @classmethod
    def _default_kind(cls, value: Any) -> Any:
        """A `peft` section without `kind` (e.g. `--set finetune.peft.params.r=4`) changes the default LoRA."""
        if isinstance(value, dict) and "kind" not in value:
            return {**DEFAULT_PEFT.model_dump(mode="json"), **value}
        return value

    @field_validator("base_mapping")
    @classmethod
    def _known_mapping(cls, name: str | None) -> str | None:
        if name is not None and not name.endswith("-to-d9d"):
            valid = [mapping for mapping in NAMED_MAPPINGS if mapping.endswith("-to-d9d")]
            raise ValueError(f"base_mapping={name!r} must read into d9d's layout; valid: {', '.join(valid)}")
        return name

    @model_validator(mode="after")
    def _mapping_needs_a_base(self) -> FinetuneStageConfig:
        if self.base_mapping is not None and self.base is None:
            raise ValueError(f"base_mapping={self.base_mapping!r} needs finetune.base (the checkpoint it reads)")
        return self


class FinetuneRankConfig(BaseModel):
    """What every fine-tune rank reads (`job.yaml`): the job's `finetune` section as the user set it, the model and
    the packed row length, and where this run reads and writes (resolved by the stage)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: FinetuneStageConfig
    model: AnyModelConfig
    seq_len: int = Field(gt=0)
    base: Path = Field(
        description="the base: a job checkpoint folder, a directory of them (newest complete), or a safetensors "
        "checkpoint (d9d layout, or read through stage.base_mapping)"
    )
    train_shards: Path
    validation_shards: Path | None = None
    checkpoints: Path = Field(description="adapter-only job checkpoints; the newest complete one is resumed")
    output: Path = Field(description="merged/ (d9d-layout safetensors), adapter/ and finetune.json go here")
    tracker: AnyTrackerConfig = Field(
        default_factory=NoTrackerConfig, description="experiment tracker (rank 0 writes), e.g. jsonl or aim"
    )
