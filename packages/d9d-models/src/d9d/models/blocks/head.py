"""The language-modelling head over a split vocabulary (see `SplitTokenEmbedding`), with a chunked loss."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import overload

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import register_dataclass as register_pytree_dataclass

from d9d.kernels.linear_cross_entropy import EagerLinearCrossEntropy, LinearCrossEntropyKernel
from d9d.models.blocks.embedding import check_segments, weight_of
from d9d.models.blocks.late_init import init_normal_
from d9d.models.blocks.loss import chunked_linear_cross_entropy
from d9d.parallel.tensor import (
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_sum,
    vocab_parallel_logits,
)


@dataclass(frozen=True)
class LanguageModellingLoss:
    """The head's loss: `losses` per token (float32, shaped like the labels, 0 where a label is -100) and
    `loss_sum`, their sum. Backpropagate through `loss_sum` (times any scalar). With the gradients computed in
    forward (`loss_gradients_in_forward`), `loss_sum` is the only differentiable one and `losses` are detached."""

    losses: torch.Tensor
    loss_sum: torch.Tensor


# The head is an FSDP unit: FSDP2 hooks its pre-backward all-gather on the output tensors it finds by pytree.
register_pytree_dataclass(LanguageModellingLoss)


class SplitLanguageModellingHead(nn.Module):
    """`segments.<name>.weight` `(size, hidden)` per vocabulary segment; logits are over their concatenation.

    `loss_gradients_in_forward`: compute the loss gradients in forward for the loss *sum* (one logits matmul per
    chunk instead of two; design note 0023), on a vocabulary-parallel (tensor-parallel) head too."""

    def __init__(
        self, segments: Mapping[str, int], hidden_size: int, *, init_std: float = 0.02, loss_chunk_size: int = 2048,
        loss_gradients_in_forward: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.init_std = init_std
        self.loss_chunk_size = loss_chunk_size
        self.loss_gradients_in_forward = loss_gradients_in_forward
        # None: the chunked PyTorch loss of `blocks.loss`; a `d9d.kernels.linear_cross_entropy` backend otherwise.
        self.loss_kernel: LinearCrossEntropyKernel | None = None
        self.segments = nn.ModuleDict(
            {name: nn.Linear(hidden_size, size, bias=False) for name, size in check_segments(segments).items()}
        )

    def segment_weights(self) -> dict[str, torch.Tensor]:
        """Each segment's `(size, hidden)` weight, in vocabulary order."""
        return {name: weight_of(module) for name, module in self.segments.items()}

    def reset_parameters(self) -> None:
        for weight in self.segment_weights().values():
            init_normal_(weight, self.init_std)

    def weight(self) -> torch.Tensor:
        """The whole `(vocab, hidden)` weight (a concatenation when there are several segments)."""
        weights = list(self.segment_weights().values())
        return weights[0] if len(weights) == 1 else torch.cat(weights)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits in the compute dtype, as `forward(hidden)`; call `forward` on a parallelised model, whose
        parameter-gathering hooks run around `forward` only."""
        return hidden @ self.weight().T

    @overload
    def forward(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @overload
    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> LanguageModellingLoss: ...

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | LanguageModellingLoss:
        """The loss against `labels` (`LanguageModellingLoss`); full logits without labels."""
        weight = self.weight()
        if labels is None:
            if isinstance(weight, DTensor):  # tensor parallel: this rank holds a slice of the vocabulary
                return vocab_parallel_logits(hidden, weight)
            return self.logits(hidden)
        if self.loss_gradients_in_forward:
            return self._summed_loss(hidden, weight, labels)
        losses = self._per_token_losses(hidden, weight, labels)
        return LanguageModellingLoss(losses=losses, loss_sum=losses.sum())

    def _per_token_losses(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, DTensor):
            return vocab_parallel_cross_entropy(hidden, weight, labels, chunk_size=self.loss_chunk_size)
        if self.loss_kernel is not None:
            return self.loss_kernel(hidden, weight, labels, chunk_size=self.loss_chunk_size)
        return chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=self.loss_chunk_size)

    def _summed_loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> LanguageModellingLoss:
        if isinstance(weight, DTensor):  # tensor parallel: the vocabulary-parallel loss, summed
            total, losses = vocab_parallel_cross_entropy_sum(hidden, weight, labels, chunk_size=self.loss_chunk_size)
            return LanguageModellingLoss(losses=losses, loss_sum=total)
        kernel = self.loss_kernel if self.loss_kernel is not None else EagerLinearCrossEntropy()
        summed = kernel.summed(hidden, weight, labels, chunk_size=self.loss_chunk_size)
        return LanguageModellingLoss(losses=summed.losses, loss_sum=summed.total)
