"""The RMSNorm kernel interface and its eager backend."""

from __future__ import annotations

from typing import Protocol

import torch

from d9d.kernels.rms_norm.reference import rms_norm_reference
from d9d.kernels.triton_support import any_dtensor


class RmsNormKernel(Protocol):
    """`(weight * normalise(x + residual), x + residual)` over the last dimension; without `residual` the second
    item is `x`. Differentiable in `x`, `residual` and `weight`."""

    name: str

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, *, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class EagerRmsNorm:
    """Plain PyTorch ops (`rms_norm_reference`): any device and dtype."""

    name = "eager"

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, *, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_reference(x, weight, eps=eps, residual=residual)


class TritonRmsNorm:
    """The Triton kernels as custom ops (`d9d.kernels.rms_norm.ops`); imports Triton when built."""

    name = "triton"

    def __init__(self) -> None:
        from d9d.kernels.triton_support import import_triton

        import_triton()
        from d9d.kernels.rms_norm import ops

        self._ops = ops

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, *, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if any_dtensor(x, weight, residual):
            return rms_norm_reference(x, weight, eps=eps, residual=residual)
        return self._ops.rms_norm(x, weight, eps=eps, residual=residual)
