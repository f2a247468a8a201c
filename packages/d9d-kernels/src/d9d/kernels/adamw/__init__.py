"""The fused stochastic-rounding AdamW step (Triton), registered into d9d-core's `StochasticAdamW(fused=True)`.

from d9d.kernels.adamw import register_triton_stochastic_adamw
register_triton_stochastic_adamw()  # once, at program wiring; then StochasticAdamWConfig(fused=True) uses it
"""

from __future__ import annotations

import torch

from d9d.core.optim import AdamWStepParameters, register_fused_stochastic_adamw_step


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


def register_triton_stochastic_adamw() -> None:
    """Make the Triton step the one `StochasticAdamW(fused=True)` runs (raises `BackendUnavailable` without Triton)."""
    from d9d.kernels.triton_support import import_triton

    import_triton()
    register_fused_stochastic_adamw_step(triton_stochastic_adamw_step)


__all__ = ["register_triton_stochastic_adamw", "triton_stochastic_adamw_step"]
