"""The fused linear + cross-entropy interface, the eager (PyTorch, chunked) backend and the Triton backend."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from d9d.kernels.linear_cross_entropy.chunks import (
    LogitStats,
    flatten_tokens,
    logit_gradients,
    logit_stats,
    logit_stats_and_gradients,
    losses_from_stats,
)
from d9d.kernels.linear_cross_entropy.reference import TorchChunkMath
from d9d.kernels.linear_cross_entropy.summed import SummedLoss, summed_function, summed_linear_cross_entropy
from d9d.kernels.split_backward import wanted_backward_halves
from d9d.kernels.triton_support import any_dtensor


class LinearCrossEntropyKernel(Protocol):
    """Per-token float32 cross-entropy of `hidden @ weight.T`, shaped like `labels`, never holding more than
    `chunk_size` tokens' logits. `hidden` `(..., H)`, `weight` `(V, H)`, `labels` `(...)` with -100 for no loss
    (its loss is 0). Differentiable in `hidden` and `weight`.

    `summed` is the same loss reduced by a sum, with the gradients computed in forward from one logits matmul per
    chunk (backward only scales them): cheaper whenever the caller backpropagates through the sum."""

    name: str

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
    ) -> torch.Tensor: ...

    def summed(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
    ) -> SummedLoss: ...


_TORCH_MATH = TorchChunkMath()


class _EagerLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
    ) -> torch.Tensor:
        stats: LogitStats = logit_stats(hidden, weight, labels, vocab_start=0, chunk_size=chunk_size, math=_TORCH_MATH)
        ctx.save_for_backward(hidden, weight, labels, stats.logsumexp())
        ctx.chunk_size = chunk_size
        return losses_from_stats(stats, labels)

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        want_input, want_weight = wanted_backward_halves()  # a pipeline's split backward uses one per pass
        grad_hidden, grad_weight = logit_gradients(
            hidden, weight, labels, lse, grad_losses, vocab_start=0, chunk_size=ctx.chunk_size, math=_TORCH_MATH,
            want_input=want_input and ctx.needs_input_grad[0], want_weight=want_weight and ctx.needs_input_grad[1],
        )  # fmt: skip
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def _eager_losses_and_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, *, want_input: bool,
    want_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    result = logit_stats_and_gradients(
        hidden, weight, labels, chunk_size=chunk_size, math=_TORCH_MATH, want_input=want_input, want_weight=want_weight
    )
    return losses_from_stats(result.stats, labels), result.grad_hidden, result.grad_weight


_EagerSummedLinearCrossEntropy = summed_function(_eager_losses_and_gradients)


class EagerLinearCrossEntropy:
    """The chunked algorithm with PyTorch ops per chunk: any device and dtype."""

    name = "eager"

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
    ) -> torch.Tensor:
        flat_hidden, flat_labels = flatten_tokens(hidden, labels, chunk_size)
        losses = _EagerLinearCrossEntropy.apply(flat_hidden, weight, flat_labels, chunk_size)  # type: ignore[no-untyped-call]
        assert isinstance(losses, torch.Tensor)
        return losses.view(labels.shape)

    def summed(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
    ) -> SummedLoss:
        return summed_linear_cross_entropy(hidden, weight, labels, chunk_size, _EagerSummedLinearCrossEntropy)


class TritonLinearCrossEntropy:
    """Triton kernels for the per-chunk softmax statistics and gradient (custom ops in
    `d9d.kernels.linear_cross_entropy.ops`); imports Triton when built."""

    name = "triton"

    def __init__(self) -> None:
        from d9d.kernels.triton_support import import_triton

        import_triton()
        from d9d.kernels.linear_cross_entropy import ops

        self._ops = ops

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
    ) -> torch.Tensor:
        if any_dtensor(hidden, weight):
            return EagerLinearCrossEntropy()(hidden, weight, labels, chunk_size=chunk_size)
        flat_hidden, flat_labels = flatten_tokens(hidden, labels, chunk_size)
        losses = self._ops.fused_linear_cross_entropy(
            flat_hidden.contiguous(), weight, flat_labels.contiguous(), chunk_size=chunk_size
        )
        return losses.view(labels.shape)

    def summed(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
    ) -> SummedLoss:
        if any_dtensor(hidden, weight):
            return EagerLinearCrossEntropy().summed(hidden, weight, labels, chunk_size=chunk_size)
        summed: SummedLoss = self._ops.summed_fused_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
        return summed
