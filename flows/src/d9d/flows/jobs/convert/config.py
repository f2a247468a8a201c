"""Configuration of the convert stage: which named mapping, from which checkpoint."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from d9d.models.conversions import NAMED_MAPPINGS
from d9d.states import DEFAULT_SHARD_BYTES


class ConvertConfig(BaseModel):
    """Convert a checkpoint with a named mapping (`d9d convert --list`).

    With no `source`, the stage first writes a randomly initialised model with the pretrain section's architecture
    (Qwen3 dense or MoE, its parameters) in the Hugging Face layout (d9d's own mapper, seeded by `seed`) next to its
    output, so the embedded pipeline converts a real checkpoint without downloading one and without `transformers`,
    and the pretrain stage starts from the converted weights (`pretrain.init_from: convert`), as a user's job would.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mapping: str | None = Field(
        default=None,
        description="a name from `d9d convert --list`; None: the HF -> d9d mapping of the random source's family "
        "(only without `source`)",
    )
    source: Path | None = Field(default=None, description="the checkpoint directory to convert; none: a random one")
    output: Path | None = Field(default=None, description="default: <workdir>/model")
    seed: int = Field(default=0, description="seed of the random source checkpoint (when `source` is not set)")
    max_shard_bytes: int = Field(default=DEFAULT_SHARD_BYTES, gt=0)
    retries: int = Field(default=0, ge=0)
    retry_delay_seconds: float = Field(default=10.0, ge=0)

    @field_validator("mapping")
    @classmethod
    def _known_mapping(cls, name: str | None) -> str | None:
        if name is not None and name not in NAMED_MAPPINGS:
            raise ValueError(f"unknown mapping {name!r}; valid: {', '.join(NAMED_MAPPINGS)}")
        return name

    @model_validator(mode="after")
    def _mapping_for_a_source(self) -> ConvertConfig:
        if self.source is not None and self.mapping is None:
            raise ValueError(
                f"source={self.source} needs a mapping: set convert.mapping to one of {', '.join(NAMED_MAPPINGS)}"
            )
        return self
