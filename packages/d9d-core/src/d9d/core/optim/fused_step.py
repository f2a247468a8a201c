"""The extension points for a fused `StochasticAdamW` update: core defines the contracts, a kernel package fills them.

`StochasticAdamW(fused=True)` hands the local tensors of its parameters to a registered kernel instead of running its
own PyTorch ops. Two contracts:

- `FusedStochasticAdamWStep` updates one parameter per call (required for `fused=True`);
- `FusedStochasticAdamWMultiStep` updates a whole bucket of parameters per call (optional): the parameters of one
  group that share dtypes, device and step count, so one kernel launch replaces a Python loop of launches whose host
  time (hundreds of parameters) otherwise exceeds the update's device time.

Both must give the same bits for the same seeds, so a run may switch between them. Core names no kernel: whoever
provides one calls the `register_*` functions (typically at program wiring time).
"""

from __future__ import annotations

from collections.abc import Sequence
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


class FusedStochasticAdamWMultiStep(Protocol):
    def __call__(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor],
        exp_avg_sqs: Sequence[torch.Tensor],
        *,
        hyper: AdamWStepParameters,
        seeds: Sequence[tuple[int, int, int]],
    ) -> None:
        """Apply `FusedStochasticAdamWStep` to every `(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i])` with
        `seeds[i]`, giving the same bits as one call per tensor would. The bucket shares `hyper` (the group's
        hyperparameters and one step count); within each list every tensor has one dtype and one device, and both
        moment lists share a dtype. Tensors are local, contiguous, and may be empty."""
        ...


_registered: list[FusedStochasticAdamWStep] = []
_registered_multi: list[FusedStochasticAdamWMultiStep] = []


def register_fused_stochastic_adamw_step(step: FusedStochasticAdamWStep) -> None:
    """Make `step` the update of every `StochasticAdamW(fused=True)` (replaces an earlier registration)."""
    _registered[:] = [step]


def register_fused_stochastic_adamw_multi_step(step: FusedStochasticAdamWMultiStep | None) -> None:
    """Make `step` the bucketed update of every `StochasticAdamW(fused=True)` built afterwards (replaces an earlier
    registration; None removes it, and the optimizer calls the per-parameter step in a loop)."""
    _registered_multi[:] = [] if step is None else [step]


def registered_fused_stochastic_adamw_step() -> FusedStochasticAdamWStep:
    """The registered step; a clear error when none is."""
    if not _registered:
        raise ValueError(
            "StochasticAdamW(fused=True) needs a fused step, and none is registered: call "
            "d9d.core.optim.register_fused_stochastic_adamw_step(step) first (a kernel package provides one), "
            "or use fused=False"
        )
    return _registered[0]


def registered_fused_stochastic_adamw_multi_step() -> FusedStochasticAdamWMultiStep | None:
    """The registered multi-tensor step, or None (optional: the per-parameter step covers every case)."""
    return _registered_multi[0] if _registered_multi else None
