"""The Triton fused linear + cross-entropy as torch custom ops with fake implementations, and its autograd.

Ops (`d9d_kernels::` prefix): `linear_cross_entropy_stats` (forward: per-token `LogitStats` of one vocabulary shard),
`linear_cross_entropy_backward` (both gradients from one recomputation of the logits), and the split halves
`linear_cross_entropy_backward_input` / `linear_cross_entropy_backward_weight` for pipeline schedules (each
recomputes the logits itself: a split backward costs one more logits matmul than the fused one), and
`linear_cross_entropy_with_gradients` (the summed loss: per-token losses and the gradients of their sum, computed in
forward; its autograd function, in `summed.py`, only scales them in backward).
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.kernels.linear_cross_entropy.chunks import (
    LogitStats,
    logit_gradients,
    logit_stats,
    logit_stats_and_gradients,
    losses_from_stats,
)
from d9d.kernels.linear_cross_entropy.summed import SummedLoss, summed_function, summed_linear_cross_entropy
from d9d.kernels.linear_cross_entropy.triton_kernels import TritonChunkMath
from d9d.kernels.split_backward import wanted_backward_halves
from d9d.kernels.triton_support import check_triton_device, kernel_op

_MATH = TritonChunkMath()


@kernel_op("d9d_kernels::linear_cross_entropy_stats")
def _stats_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_triton_device(hidden, weight)
    stats = logit_stats(hidden, weight, targets, vocab_start=vocab_start, chunk_size=chunk_size, math=_MATH)
    return stats.max, stats.sum_exp, stats.target_logit


@_stats_op.register_fake
def _(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3))  # type: ignore[return-value]


def _gradients(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    vocab_start: int, chunk_size: int, *, want_input: bool, want_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    check_triton_device(hidden, weight)
    grad_hidden, grad_weight = logit_gradients(
        hidden, weight, targets, lse, grad_losses, vocab_start=vocab_start, chunk_size=chunk_size, math=_MATH,
        want_input=want_input, want_weight=want_weight,
    )  # fmt: skip
    return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)


@kernel_op("d9d_kernels::linear_cross_entropy_backward")
def _backward_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    vocab_start: int, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    grad_hidden, grad_weight = _gradients(
        hidden, weight, targets, lse, grad_losses, vocab_start, chunk_size, want_input=True, want_weight=True
    )
    assert grad_hidden is not None
    assert grad_weight is not None
    return grad_hidden, grad_weight


@_backward_op.register_fake
def _(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    vocab_start: int, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(hidden), torch.empty_like(weight)


@kernel_op("d9d_kernels::linear_cross_entropy_backward_input")
def _backward_input_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    vocab_start: int, chunk_size: int,
) -> torch.Tensor:  # fmt: skip
    grad_hidden, _ = _gradients(
        hidden, weight, targets, lse, grad_losses, vocab_start, chunk_size, want_input=True, want_weight=False
    )
    assert grad_hidden is not None
    return grad_hidden


@_backward_input_op.register_fake
def _(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    vocab_start: int, chunk_size: int,
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(hidden)


@kernel_op("d9d_kernels::linear_cross_entropy_backward_weight")
def _backward_weight_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    vocab_start: int, chunk_size: int,
) -> torch.Tensor:  # fmt: skip
    _, grad_weight = _gradients(
        hidden, weight, targets, lse, grad_losses, vocab_start, chunk_size, want_input=False, want_weight=True
    )
    assert grad_weight is not None
    return grad_weight


@_backward_weight_op.register_fake
def _(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    vocab_start: int, chunk_size: int,
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(weight)


def shard_logit_stats(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, vocab_start: int = 0, chunk_size: int = 2048
) -> LogitStats:
    """This vocabulary shard's `LogitStats` (`weight` holds vocabulary rows `[vocab_start, vocab_start + V)`);
    no gradient flows through them (a vocabulary-parallel loss composes its own autograd from these pieces)."""
    maximum, sum_exp, target = _stats_op(hidden, weight, labels, vocab_start, chunk_size)
    return LogitStats(max=maximum, sum_exp=sum_exp, target_logit=target)


def linear_cross_entropy_backward_input(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    *, vocab_start: int = 0, chunk_size: int = 2048,
) -> torch.Tensor:  # fmt: skip
    """Gradient of `hidden` through this shard (the shards' gradients sum to the full one)."""
    out: torch.Tensor = _backward_input_op(hidden, weight, labels, lse, grad_losses, vocab_start, chunk_size)
    return out


def linear_cross_entropy_backward_weight(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    *, vocab_start: int = 0, chunk_size: int = 2048,
) -> torch.Tensor:  # fmt: skip
    """Gradient of this shard's `weight`, in its dtype (accumulated over chunks in float32)."""
    out: torch.Tensor = _backward_weight_op(hidden, weight, labels, lse, grad_losses, vocab_start, chunk_size)
    return out


class _TritonLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
    ) -> torch.Tensor:
        maximum, sum_exp, target = _stats_op(hidden, weight, labels, 0, chunk_size)
        stats = LogitStats(max=maximum, sum_exp=sum_exp, target_logit=target)
        ctx.save_for_backward(hidden, weight, labels, stats.logsumexp())
        ctx.chunk_size = chunk_size
        return losses_from_stats(stats, labels)

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_losses = grad_losses.contiguous()
        want_input, want_weight = wanted_backward_halves()  # a pipeline's split backward uses one per pass
        want_input, want_weight = want_input and ctx.needs_input_grad[0], want_weight and ctx.needs_input_grad[1]
        if want_input and want_weight:
            grad_hidden, grad_weight = _backward_op(hidden, weight, labels, lse, grad_losses, 0, ctx.chunk_size)
            return grad_hidden, grad_weight, None, None
        input_half: torch.Tensor | None = (
            _backward_input_op(hidden, weight, labels, lse, grad_losses, 0, ctx.chunk_size) if want_input else None
        )
        weight_half: torch.Tensor | None = (
            _backward_weight_op(hidden, weight, labels, lse, grad_losses, 0, ctx.chunk_size) if want_weight else None
        )
        return input_half, weight_half, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
) -> torch.Tensor:
    """Per-token float32 losses of `hidden @ weight.T` `(N, H) x (V, H)` against `labels` `(N,)` (-100: no loss)."""
    losses = _TritonLinearCrossEntropy.apply(hidden, weight, labels, chunk_size)  # type: ignore[no-untyped-call]
    assert isinstance(losses, torch.Tensor)
    return losses


@kernel_op("d9d_kernels::linear_cross_entropy_with_gradients")
def _with_gradients_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, want_input: bool,
    want_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-token losses, the gradient of their sum in `hidden` (empty `(0,)` unless `want_input`) and in `weight`
    (float32; empty unless `want_weight`), from one logits matmul per chunk."""
    check_triton_device(hidden, weight)
    result = logit_stats_and_gradients(
        hidden, weight, targets, chunk_size=chunk_size, math=_MATH, want_input=want_input, want_weight=want_weight
    )
    grad_hidden = hidden.new_empty(0) if result.grad_hidden is None else result.grad_hidden
    grad_weight = hidden.new_empty(0, dtype=torch.float32) if result.grad_weight is None else result.grad_weight
    return losses_from_stats(result.stats, targets), grad_hidden, grad_weight


@_with_gradients_op.register_fake
def _(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, want_input: bool,
    want_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    losses = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if want_input else hidden.new_empty(0)
    grad_weight = weight.new_empty(weight.shape if want_weight else (0,), dtype=torch.float32)
    return losses, grad_hidden, grad_weight


def _triton_losses_and_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, *, want_input: bool,
    want_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    losses, grad_hidden, grad_weight = _with_gradients_op(hidden, weight, labels, chunk_size, want_input, want_weight)
    return losses, grad_hidden if want_input else None, grad_weight if want_weight else None


_TritonSummedLinearCrossEntropy = summed_function(_triton_losses_and_gradients)


def summed_fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
) -> SummedLoss:
    """The sum of the per-token losses of `hidden @ weight.T` `(N, H) x (V, H)` against `labels` `(N,)`, its
    gradients computed in forward (see `SummedLoss`)."""
    return summed_linear_cross_entropy(hidden, weight, labels, chunk_size, _TritonSummedLinearCrossEntropy)
