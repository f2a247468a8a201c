"""The extension point for a fused `StochasticAdamW` update: core defines the contract, a kernel package fills it.

`StochasticAdamW(fused=True)` hands each parameter's local tensors to the registered `FusedStochasticAdamWStep`
instead of running its own PyTorch ops. Core names no kernel: whoever provides one calls
`register_fused_stochastic_adamw_step(step)` (typically at program wiring time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class AdamWStepParameters:
    """One parameter's hyperparameters at this step (`step` counts from 1, as torch.optim.AdamW's)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int


class FusedStochasticAdamWStep(Protocol):
    def __call__(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        hyper: AdamWStepParameters,
        seeds: tuple[int, int, int],
    ) -> None:
        """Update `param`, `exp_avg`, `exp_avg_sq` (local, same shape, contiguous) in place with exactly
        torch.optim.AdamW's float32 arithmetic, writing bfloat16 tensors with stochastic rounding whose noise comes
        from `seeds` (one per tensor, in that order), so replicas given equal seeds stay bit-equal."""
        ...


_registered: list[FusedStochasticAdamWStep] = []


def register_fused_stochastic_adamw_step(step: FusedStochasticAdamWStep) -> None:
    """Make `step` the update of every `StochasticAdamW(fused=True)` (replaces an earlier registration)."""
    _registered[:] = [step]


def registered_fused_stochastic_adamw_step() -> FusedStochasticAdamWStep:
    """The registered step; a clear error when none is."""
    if not _registered:
        raise ValueError(
            "StochasticAdamW(fused=True) needs a fused step, and none is registered: call "
            "d9d.core.optim.register_fused_stochastic_adamw_step(step) first (a kernel package provides one), "
            "or use fused=False"
        )
    return _registered[0]
