"""PEFT configuration: a discriminated union on `kind` (LoRA, full tune, a stack of methods)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class LoRAParameters(BaseModel):
    """Rank `r`, scaling `alpha / r` (rsLoRA: `alpha / sqrt(r)`), dropout on the adapter's input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    rslora: bool = Field(default=False, description="scale by alpha / sqrt(r) (rank-stabilised LoRA)")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


class LoRAConfig(BaseModel):
    """LoRA on every `nn.Linear` or grouped-expert linear whose qualified name fully matches the pattern."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["lora"] = "lora"
    module_name_pattern: re.Pattern[str] = Field(description=r"re.fullmatch on module names, e.g. .*\.(q|v)_proj")
    params: LoRAParameters = Field(default_factory=LoRAParameters)


class FullTuneConfig(BaseModel):
    """Train every parameter of the modules whose qualified name fully matches the pattern."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["full_tune"] = "full_tune"
    module_name_pattern: re.Pattern[str]


class PeftStackConfig(BaseModel):
    """Several methods applied in order (e.g. LoRA on attention plus full tune of the norms)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["stack"] = "stack"
    methods: list[AnyPeftConfig] = Field(min_length=1)


AnyPeftConfig = Annotated[LoRAConfig | FullTuneConfig | PeftStackConfig, Field(discriminator="kind")]

PeftStackConfig.model_rebuild()
