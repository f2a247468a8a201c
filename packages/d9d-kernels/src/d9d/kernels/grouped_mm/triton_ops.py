"""The Triton grouped GEMM as torch custom ops with fake implementations, and its autograd.

Ops (`d9d_kernels::` prefix): `grouped_mm_forward`, and the split halves of backward `grouped_mm_backward_input`
(`grad @ weight[e]` per group) and `grouped_mm_backward_weight` (`grad[rows e].T @ x[rows e]` per group).
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.kernels.grouped_mm import triton_kernels
from d9d.kernels.triton_support import check_triton_device, kernel_op


@kernel_op("d9d_kernels::grouped_mm_forward")
def _forward_op(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    check_triton_device(x, weight, offsets)
    return triton_kernels.forward(x, weight, offsets)


@_forward_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[1]))


@kernel_op("d9d_kernels::grouped_mm_backward_input")
def _backward_input_op(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    check_triton_device(grad, weight, offsets)
    return triton_kernels.backward_input(grad, weight, offsets)


@_backward_input_op.register_fake
def _(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grad.new_empty((grad.shape[0], weight.shape[2]))


@kernel_op("d9d_kernels::grouped_mm_backward_weight")
def _backward_weight_op(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    check_triton_device(grad, x, offsets)
    return triton_kernels.backward_weight(grad, x, offsets, offsets.shape[0] - 1)


@_backward_weight_op.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty((offsets.shape[0] - 1, grad.shape[1], x.shape[1]))


def grouped_mm_backward_input(grad: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Gradient of `x` `(N, K)` for the output gradient `grad` `(N, M)`."""
    out: torch.Tensor = _backward_input_op(
        grad.contiguous(), weight.contiguous(), triton_kernels.group_offsets(group_sizes)
    )
    return out


def grouped_mm_backward_weight(grad: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Gradient of `weight` `(E, M, K)` in `x`'s dtype (float32 accumulation); zeros for empty groups."""
    out: torch.Tensor = _backward_weight_op(
        grad.contiguous(), x.contiguous(), triton_kernels.group_offsets(group_sizes)
    )
    return out


class _GroupedMm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        offsets = triton_kernels.group_offsets(group_sizes)
        ctx.save_for_backward(x, weight, offsets)
        out: torch.Tensor = _forward_op(x, weight, offsets)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _backward_input_op(grad, weight, offsets) if ctx.needs_input_grad[0] else None
        grad_weight = _backward_weight_op(grad, x, offsets).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    out = _GroupedMm.apply(x, weight, group_sizes)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out
