"""Optimizer configuration (pydantic, unknown keys rejected) and `build_optimizer`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, assert_never

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.optim import AdamW, Optimizer

from d9d.core.optim.stochastic_adamw import StochasticAdamW


class _AdamWBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(default=1e-3, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, ge=0)
    weight_decay: float = Field(default=1e-2, ge=0)


class AdamWConfig(_AdamWBase):
    """`torch.optim.AdamW`; `foreach`/`fused` as PyTorch takes them (None: its default for the device)."""

    kind: Literal["adamw"] = "adamw"
    foreach: bool | None = None
    fused: bool | None = None


class StochasticAdamWConfig(_AdamWBase):
    """`StochasticAdamW`: AdamW for bfloat16 parameters with stochastic rounding (see its module)."""

    kind: Literal["stochastic_adamw"] = "stochastic_adamw"
    seed: int = 0
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    fused: bool = False  # the registered fused step (see d9d.core.optim.fused_step); the PyTorch ops otherwise


AnyOptimizerConfig = Annotated[AdamWConfig | StochasticAdamWConfig, Field(discriminator="kind")]


def build_optimizer(config: AnyOptimizerConfig, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> Optimizer:
    """The configured optimizer over `params` (plain tensors or DTensors; neither communicates in its step)."""
    match config:
        case AdamWConfig():
            return AdamW(
                params,
                lr=config.lr,
                betas=config.betas,
                eps=config.eps,
                weight_decay=config.weight_decay,
                foreach=config.foreach,
                fused=config.fused,
            )
        case StochasticAdamWConfig():
            return StochasticAdamW(
                params,
                lr=config.lr,
                betas=config.betas,
                eps=config.eps,
                weight_decay=config.weight_decay,
                seed=config.seed,
                state_dtype=torch.bfloat16 if config.state_dtype == "bfloat16" else torch.float32,
                fused=config.fused,
            )
        case _:
            assert_never(config)
