"""The summed fused loss: its gradients are computed in forward, and backward only scales them.

The gradient of `sum_i loss_i` reaches every token with the same weight, so forward can form `softmax - onehot` right
after each chunk's logits matmul and multiply it into both gradients while the logits are at hand: one logits matmul
per chunk instead of two (backward used to recompute them), and no per-token `grad_losses` to wait for. Backward
receives one scalar `g` (the caller's scaling of the sum, e.g. `1 / tokens`) and returns `g * grad` for each saved
gradient. That is exact for `loss_sum * g` and only for that, so the reduction is part of the API: the result is a
`SummedLoss` whose `total` carries the gradient and whose per-token `losses` are detached (for metrics).

The weight gradient is kept in float32 from forward to backward (the sum over chunks is float32, and it is rounded to
the weight's dtype once, after scaling); the hidden-state gradient is kept in the compute dtype, as the chunk matmul
produced it. Under a pipeline's split backward each pass returns only its half (`wanted_backward_halves`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from d9d.kernels.linear_cross_entropy.chunks import flatten_tokens
from d9d.kernels.split_backward import wanted_backward_halves


class LossesAndGradients(Protocol):
    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, *, want_input: bool,
        want_weight: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """Per-token losses and the gradients of their sum (`None` when not wanted), on flat `(N, H)` / `(N,)`
        inputs."""
        ...


@dataclass(frozen=True)
class SummedLoss:
    """`total`: the float32 sum of the per-token losses, differentiable (backward scales the gradients computed in
    forward by `total`'s incoming gradient). `losses`: the per-token losses shaped like the labels, detached."""

    total: torch.Tensor
    losses: torch.Tensor


def scaled_gradient(saved: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`saved * scale` rounded once to `dtype` (a gradient computed in forward, times the sum's incoming one)."""
    # One kernel: multiply in the saved (float32 for the weight) precision, round once to the parameter's dtype.
    return torch.mul(saved, scale, out=torch.empty(saved.shape, dtype=dtype, device=saved.device))


def summed_function(compute: LossesAndGradients) -> type[torch.autograd.Function]:
    """An autograd function over `compute`: `apply(hidden, weight, labels, chunk_size, want_input, want_weight)`
    returns `(total, losses)`."""

    class _SummedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(  # noqa: PLR0917 - autograd.Function.forward takes its inputs positionally
            ctx: Any,
            hidden: torch.Tensor,
            weight: torch.Tensor,
            labels: torch.Tensor,
            chunk_size: int,
            want_input: bool,
            want_weight: bool,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            losses, grad_hidden, grad_weight = compute(
                hidden, weight, labels, chunk_size, want_input=want_input, want_weight=want_weight
            )
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.dtypes = hidden.dtype, weight.dtype
            ctx.mark_non_differentiable(losses)
            return losses.sum(), losses

        @staticmethod
        def backward(ctx: Any, grad_total: torch.Tensor, _grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            grad_hidden, grad_weight = ctx.saved_tensors
            want_input, want_weight = wanted_backward_halves()  # a pipeline's split backward uses one per pass
            hidden_dtype, weight_dtype = ctx.dtypes
            want_input, want_weight = want_input and grad_hidden is not None, want_weight and grad_weight is not None
            return (
                scaled_gradient(grad_hidden, grad_total, hidden_dtype) if want_input else None,
                scaled_gradient(grad_weight, grad_total, weight_dtype) if want_weight else None,
                None,
                None,
                None,
                None,
            )

    return _SummedLinearCrossEntropy


def summed_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, function: type[Any]
) -> SummedLoss:
    """Flatten the tokens, run `function` (from `summed_function`) and shape the per-token losses like `labels`.
    Gradients are computed only for the inputs that need them (none under `torch.no_grad()`)."""
    flat_hidden, flat_labels = flatten_tokens(hidden, labels, chunk_size)
    grad_enabled = torch.is_grad_enabled()
    total, losses = function.apply(
        flat_hidden.contiguous(), weight, flat_labels.contiguous(), chunk_size,
        grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad,
    )  # fmt: skip
    return SummedLoss(total=total, losses=losses.view(labels.shape))
