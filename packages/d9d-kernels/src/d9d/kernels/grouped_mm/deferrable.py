"""`deferrable_grouped_mm`: a grouped matmul backend whose weight gradient a pipeline's split backward can defer.

The MoE experts' counterpart of `d9d.kernels.deferrable_linear`: outside a forward a registered weight-gradient
sink marks, or for a backend without known halves, it is `backend(x, weight, group_sizes)` unchanged. Inside one,
with plain-tensor operands (`may_defer`), it records `_DeferrableGroupedMm`, whose backward computes the input half
with the backend's own kernel and queues the weight half (`grad[rows e]^T @ x[rows e]` per expert, one `(E, M, K)`
gradient) while a store collects, or computes it at once otherwise. Halves per backend:

- eager: the same Python loop of matmuls as its forward (`grad @ weight[e]`; `grad^T @ x` per group);
- torch: `torch._grouped_mm(grad, weight)` and `torch._grouped_mm(grad^T, x)` with the group offsets (the products
  autograd's own `_grouped_mm` backward forms);
- triton: its split ops `grouped_mm_backward_input` / `grouped_mm_backward_weight`.

Other backends (grouped_gemm) and DTensor weights (expert parallelism hands the backend local shards through a
wrapper) keep their own autograd: their weight gradients are computed in the input pass (correct, not deferred).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from d9d.kernels.grouped_mm.api import GroupedMm
from d9d.kernels.grouped_mm.eager import EagerGroupedMm
from d9d.kernels.grouped_mm.torch_mm import TorchGroupedMm
from d9d.kernels.grouped_mm.triton import TritonGroupedMm
from d9d.kernels.weight_gradient_sink import accumulate_weight_gradient, defer_weight_gradient, may_defer

Half = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (grad, weight or x, group_sizes)


def _eager_input(grad: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return EagerGroupedMm()(grad, weight.transpose(-2, -1), group_sizes)


def _eager_weight(grad: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    sizes = [int(size) for size in group_sizes.tolist()]
    total = sum(sizes)  # rows past it are padding (GroupedMm): outside every group
    out = grad.new_zeros(len(sizes), grad.shape[1], x.shape[1])
    groups = zip(torch.split(grad[:total], sizes), torch.split(x[:total], sizes), strict=True)
    for group, (rows_grad, rows_x) in enumerate(groups):
        if rows_grad.shape[0]:
            out[group] = rows_grad.t() @ rows_x
    return out


def _offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(group_sizes, dim=0, dtype=torch.int32)


def _torch_input(grad: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(grad, weight, offs=_offsets(group_sizes))


def _torch_weight(grad: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(grad.t(), x, offs=_offsets(group_sizes))


def _halves(backend: GroupedMm) -> tuple[Half, Half] | None:
    if isinstance(backend, EagerGroupedMm):
        return _eager_input, _eager_weight
    if isinstance(backend, TorchGroupedMm):
        return _torch_input, _torch_weight
    if isinstance(backend, TritonGroupedMm):
        ops = backend._ops
        return ops.grouped_mm_backward_input, ops.grouped_mm_backward_weight
    return None


def deferrable_grouped_mm(
    backend: GroupedMm, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor
) -> torch.Tensor:
    """`backend(x, weight, group_sizes)`; under a pipeline's split backward its weight gradient can be deferred."""
    halves = _halves(backend) if may_defer(weight, x) else None
    if halves is None:
        return backend(x, weight, group_sizes)
    out: torch.Tensor = _DeferrableGroupedMm.apply(x, weight, group_sizes, backend, halves)  # type: ignore[no-untyped-call]  # untyped in torch
    return out


class _DeferrableGroupedMm(torch.autograd.Function):
    # `forward(ctx, ...)`, not a separate `setup_context`: with one, every `apply` binds its arguments through
    # `inspect.signature` (about 20 us of host time per call).
    @staticmethod
    def forward(  # noqa: PLR0917 - autograd.Function.apply passes its arguments positionally
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        group_sizes: torch.Tensor,
        backend: GroupedMm,
        halves: tuple[Half, Half],
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, group_sizes)
        ctx.halves = halves
        return backend(x, weight, group_sizes)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, group_sizes = ctx.saved_tensors
        input_half, weight_half = ctx.halves
        grad = grad.contiguous()
        grad_x = input_half(grad, weight, group_sizes) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None, None

        def work() -> None:
            with torch.no_grad():
                accumulate_weight_gradient(weight, weight_half(grad, x, group_sizes))

        if defer_weight_gradient(work):
            return grad_x, None, None, None, None
        return grad_x, weight_half(grad, x, group_sizes).to(weight.dtype), None, None, None
