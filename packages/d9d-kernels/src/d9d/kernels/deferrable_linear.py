"""`deferrable_linear`: `F.linear` whose weight gradient a pipeline's split backward can run later.

Outside a split backward it *is* `F.linear` (same op, same autograd node, same speed). When a registered sink says
the backward of this forward will be split (`weight_gradients_deferring()`, d9d.kernels.weight_gradient_sink) and
the operands are plain tensors, it records `_DeferrableLinear` instead: its backward computes `grad_x = grad @ W`
and hands `W.grad += grad^T x` (and the bias's row sum) to the collecting store, or computes them at once when no
store collects (an ordinary backward of that forward). The queued work adds into an existing gradient with one
`addmm_` (no temporary).

The custom path is taken only where it is known to be right; everything else stays `F.linear`, its weight gradient
computed by autograd in the input pass (correct, only not deferred):
- DTensor (tensor parallel) or other tensor subclasses: their linear carries placements and collectives.
- `torch.compile` tracing: the compiled graph has its own backward.
- autocast: the casts would have to be replayed in the deferred matmul.
- parameters with gradient hooks (the gradient synchroniser's post-accumulate hook counts one accumulation per
  backward) or a frozen weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's conventional alias

from d9d.kernels.weight_gradient_sink import (
    accumulate_weight_gradient,
    defer_weight_gradient,
    has_gradient_hooks,
    may_defer,
)


def _deferrable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return may_defer(weight, x, bias) and not (bias is not None and has_gradient_hooks(bias))


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; under a pipeline's split backward its weight gradient can be deferred."""
    if not _deferrable(x, weight, bias):
        return F.linear(x, weight, bias)
    out: torch.Tensor = _DeferrableLinear.apply(x, weight, bias)  # type: ignore[no-untyped-call]  # untyped in torch
    return out


def _accumulate_weight(param: torch.Tensor, grad_rows: torch.Tensor, x_rows: torch.Tensor) -> None:
    """`param.grad += grad_rows^T @ x_rows` (one fused `addmm_` when the gradient exists in the product's dtype)."""
    existing = param.grad
    if existing is not None and existing.dtype == grad_rows.dtype and not has_gradient_hooks(param):
        existing.addmm_(grad_rows.t(), x_rows)
        return
    accumulate_weight_gradient(param, grad_rows.t() @ x_rows)


def _weight_gradients(
    weight: torch.Tensor | None, bias: torch.Tensor | None, x: torch.Tensor, grad: torch.Tensor
) -> None:
    """The deferred half. No graph: the saved `x` may require grad, and `W` runs outside autograd's engine."""
    with torch.no_grad():
        grad_rows = grad.reshape(-1, grad.shape[-1])
        if weight is not None:
            _accumulate_weight(weight, grad_rows, x.reshape(-1, x.shape[-1]))
        if bias is not None:
            accumulate_weight_gradient(bias, grad_rows.sum(0))


class _DeferrableLinear(torch.autograd.Function):
    # `forward(ctx, ...)`, not a separate `setup_context`: with one, every `apply` binds its arguments through
    # `inspect.signature` (about 20 us of host time per call, seven calls per layer).
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        want_x, want_weight, want_bias = ctx.needs_input_grad
        grad_x = grad @ weight if want_x else None
        weight_param = weight if want_weight else None
        bias_param = bias if want_bias else None
        if weight_param is None and bias_param is None:
            return grad_x, None, None

        def work() -> None:
            _weight_gradients(weight_param, bias_param, x, grad)

        if defer_weight_gradient(work):
            return grad_x, None, None
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_rows.t() @ x.reshape(-1, x.shape[-1]) if want_weight else None
        grad_bias = grad_rows.sum(0) if want_bias else None
        return grad_x, grad_weight, grad_bias
