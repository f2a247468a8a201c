"""MoE permutation as torch custom ops with fake implementations, and the autograd of permute/unpermute.

Ops (`d9d_kernels::` prefix): `moe_gather_rows` (permute forward; unpermute's row gradient), `moe_combine_rows`
(unpermute forward; permute's backward) and `moe_row_dots` (the combine weights' gradient). No parameters live
here, so the backward has only input-gradient halves: `permute_backward` and `unpermute_backward`.
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.kernels.moe_permute import triton_kernels
from d9d.kernels.triton_support import check_triton_device, kernel_op


@kernel_op("d9d_kernels::moe_gather_rows")
def _gather_op(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None, divisor: int) -> torch.Tensor:
    check_triton_device(src, index)
    return triton_kernels.gather(src, index, scale, divisor)


@_gather_op.register_fake
def _(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None, divisor: int) -> torch.Tensor:
    return src.new_empty((index.shape[0], src.shape[1]))


@kernel_op("d9d_kernels::moe_combine_rows")
def _combine_op(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, top_k: int) -> torch.Tensor:
    check_triton_device(src, index)
    return triton_kernels.combine(src, index, weights, top_k)


@_combine_op.register_fake
def _(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, top_k: int) -> torch.Tensor:
    return src.new_empty((index.shape[0] // top_k, src.shape[1]))


@kernel_op("d9d_kernels::moe_row_dots")
def _dots_op(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, top_k: int) -> torch.Tensor:
    check_triton_device(a, b, index)
    return triton_kernels.dots(a, b, index, top_k)


@_dots_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, top_k: int) -> torch.Tensor:
    return a.new_empty(index.shape[0], dtype=torch.float32)


def permute_backward(grad_rows: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Gradient of `x`: each token sums the gradients of its `k` copies."""
    out: torch.Tensor = _combine_op(grad_rows.contiguous(), inverse, None, top_k)
    return out


def unpermute_backward(
    grad_out: torch.Tensor, rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(grad_rows, grad_weights)` of the weighted combine."""
    grad_out = grad_out.contiguous()
    top_k = weights.shape[1]
    grad_rows = _gather_op(grad_out, order, weights.reshape(-1).contiguous(), top_k)
    grad_weights = _dots_op(grad_out, rows, inverse, top_k).view(weights.shape).to(weights.dtype)
    return grad_rows, grad_weights


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        out: torch.Tensor = _gather_op(x.contiguous(), order, None, top_k)
        return out

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inverse,) = ctx.saved_tensors
        return permute_backward(grad_rows, inverse, ctx.top_k), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows, weights = rows.contiguous(), weights.contiguous()
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(inverse.numel(), device=inverse.device)
        ctx.save_for_backward(rows, order, inverse, weights)
        out: torch.Tensor = _combine_op(rows, inverse, weights.reshape(-1), weights.shape[1])
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, order, inverse, weights = ctx.saved_tensors
        grad_rows, grad_weights = unpermute_backward(grad_out, rows, order, inverse, weights)
        return grad_rows, None, grad_weights


def permute(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    out = _Permute.apply(x, order, top_k)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


def unpermute(rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if weights.ndim != 2 or weights.numel() != inverse.numel() or rows.shape[0] != inverse.numel():
        raise ValueError(
            f"unpermute expects weights (T, k) with T*k = len(inverse) = rows; got weights {tuple(weights.shape)}, "
            f"inverse {tuple(inverse.shape)}, rows {tuple(rows.shape)}"
        )
    out = _Unpermute.apply(rows, inverse, weights)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out
