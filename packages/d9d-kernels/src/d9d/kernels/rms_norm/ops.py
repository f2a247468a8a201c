"""RMSNorm (+ residual add) as torch custom ops with fake implementations, and its autograd composition.

Three ops, so `torch.compile` and FSDP see through every piece and a pipeline schedule can split the backward:
`d9d_kernels::rms_norm_forward`, `d9d_kernels::rms_norm_backward_input` (gradient of `x` and of the residual: they
are the same tensor) and `d9d_kernels::rms_norm_backward_weight`. `rms_norm` runs forward and the fused backward
through autograd; `rms_norm_backward_input` / `rms_norm_backward_weight` are the two halves on their own.
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.kernels.rms_norm import triton_kernels
from d9d.kernels.triton_support import check_triton_device, kernel_op


@kernel_op("d9d_kernels::rms_norm_forward")
def _forward_op(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_triton_device(x, weight)
    out, summed, rstd = triton_kernels.forward(x, residual, weight, eps, out_dtype)
    return out, summed if summed is not None else x.new_empty(0), rstd


@_forward_op.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    del eps
    summed = torch.empty_like(x) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape, dtype=out_dtype), summed, x.new_empty(x.shape[0], dtype=torch.float32)


@kernel_op("d9d_kernels::rms_norm_backward_input")
def _backward_input_op(
    grad_out: torch.Tensor,
    summed: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    grad_summed: torch.Tensor | None,
) -> torch.Tensor:
    check_triton_device(grad_out, summed)
    return triton_kernels.backward_input(grad_out, summed, rstd, weight, grad_summed)


@_backward_input_op.register_fake
def _(
    grad_out: torch.Tensor,
    summed: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    grad_summed: torch.Tensor | None,
) -> torch.Tensor:
    return torch.empty_like(summed)


@kernel_op("d9d_kernels::rms_norm_backward_weight")
def _backward_weight_op(
    grad_out: torch.Tensor, summed: torch.Tensor, rstd: torch.Tensor, weight_dtype: torch.dtype
) -> torch.Tensor:
    check_triton_device(grad_out, summed)
    return triton_kernels.backward_weight(grad_out, summed, rstd).to(weight_dtype)


@_backward_weight_op.register_fake
def _(grad_out: torch.Tensor, summed: torch.Tensor, rstd: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    return summed.new_empty(summed.shape[1], dtype=weight_dtype)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1]).contiguous()


def rms_norm_backward_input(
    grad_out: torch.Tensor,
    summed: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    grad_summed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of the normalised input (`x + residual`), plus `grad_summed` (what later layers sent back along the
    residual stream). It is the gradient of `x` and of `residual` alike. Shaped like `summed`."""
    grad: torch.Tensor = _backward_input_op(
        _rows(grad_out), _rows(summed), rstd, weight, None if grad_summed is None else _rows(grad_summed)
    )
    return grad.view(summed.shape)


def rms_norm_backward_weight(
    grad_out: torch.Tensor, summed: torch.Tensor, rstd: torch.Tensor, weight_dtype: torch.dtype
) -> torch.Tensor:
    """Gradient of the weight: the sum over rows of `grad_out * normalise(summed)`, accumulated in float32."""
    out: torch.Tensor = _backward_weight_op(_rows(grad_out), _rows(summed), rstd, weight_dtype)
    return out


class _RmsNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _rows(x)
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        out, summed, rstd = _forward_op(rows, None if residual is None else _rows(residual), weight, eps, out_dtype)
        kept = summed if residual is not None else rows
        ctx.save_for_backward(kept, rstd, weight)
        ctx.has_residual = residual is not None
        ctx.shape = x.shape
        if residual is None:
            ctx.mark_non_differentiable(summed)
        # An output without a gradient reaches backward as None (handled there), not as a zeros tensor autograd
        # would allocate (one per norm without a residual, every backward).
        ctx.set_materialize_grads(False)
        return out.view(x.shape), summed.view(x.shape) if residual is not None else summed

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_summed: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        summed, rstd, weight = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros(
                summed.shape, dtype=torch.promote_types(weight.dtype, summed.dtype), device=summed.device
            )
        grad_out = _rows(grad_out)
        carried = grad_summed if ctx.has_residual and grad_summed is not None else None
        grad_in = rms_norm_backward_input(grad_out, summed, rstd, weight, carried).view(ctx.shape)
        grad_weight = (
            rms_norm_backward_weight(grad_out, summed, rstd, weight.dtype) if ctx.needs_input_grad[2] else None
        )
        grad_residual = grad_in if ctx.has_residual else None
        return grad_in, grad_residual, grad_weight, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight * normalise(x + residual), x + residual)` by the Triton kernels (the second item is `x` without a
    residual); numerically as `rms_norm_reference`."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x: got residual {tuple(residual.shape)} {residual.dtype}, x {tuple(x.shape)} "
            f"{x.dtype}"
        )
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be ({x.shape[-1]},) for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    out, summed = _RmsNormFunction.apply(x, residual, weight, eps)  # type: ignore[no-untyped-call]
    return out, summed if residual is not None else x
