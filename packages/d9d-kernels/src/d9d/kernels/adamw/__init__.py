"""The fused stochastic-rounding AdamW step (Triton), registered into d9d-core's `StochasticAdamW(fused=True)`.

from d9d.kernels.adamw import register_triton_stochastic_adamw
register_triton_stochastic_adamw()  # once, at program wiring; then StochasticAdamWConfig(fused=True) uses it

Two steps, the same bits: a per-parameter kernel, and a multi-tensor kernel that updates a whole bucket of
parameters (a group's parameters of one dtype and step count) in one launch; the optimizer uses the latter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from d9d.core.optim import (
    AdamWStepParameters,
    register_fused_stochastic_adamw_multi_step,
    register_fused_stochastic_adamw_step,
)


def triton_stochastic_adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    hyper: AdamWStepParameters,
    seeds: tuple[int, int, int],
) -> None:
    """The `FusedStochasticAdamWStep` of d9d-core as one Triton kernel (imports Triton on first call)."""
    from d9d.kernels.triton_support import check_triton_device, import_triton

    import_triton()
    check_triton_device(param, grad, exp_avg, exp_avg_sq)
    from d9d.kernels.adamw.triton_kernels import stochastic_adamw_step

    stochastic_adamw_step(param, grad, exp_avg, exp_avg_sq, hyper=hyper, seeds=seeds)


def triton_stochastic_adamw_multi_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    hyper: AdamWStepParameters,
    seeds: Sequence[tuple[int, int, int]],
) -> None:
    """The `FusedStochasticAdamWMultiStep` of d9d-core: one Triton launch per bucket (imports Triton on first call)."""
    from d9d.kernels.triton_support import check_triton_device, import_triton

    import_triton()
    if params:  # the launcher checks that the whole bucket shares the first parameter's device
        check_triton_device(params[0])
    from d9d.kernels.adamw.multi_tensor import stochastic_adamw_multi_step

    stochastic_adamw_multi_step(params, grads, exp_avgs, exp_avg_sqs, hyper=hyper, seeds=seeds)


def register_triton_stochastic_adamw(*, multi_tensor: bool = True) -> None:
    """Make the Triton steps the ones `StochasticAdamW(fused=True)` runs (raises `BackendUnavailable` without Triton).

    `multi_tensor=False` registers the per-parameter step alone (and removes a registered multi-tensor step): one
    launch per parameter, as before the multi-tensor kernel; for comparisons."""
    from d9d.kernels.triton_support import import_triton

    import_triton()
    register_fused_stochastic_adamw_step(triton_stochastic_adamw_step)
    register_fused_stochastic_adamw_multi_step(triton_stochastic_adamw_multi_step if multi_tensor else None)


__all__ = ["register_triton_stochastic_adamw", "triton_stochastic_adamw_multi_step", "triton_stochastic_adamw_step"]
