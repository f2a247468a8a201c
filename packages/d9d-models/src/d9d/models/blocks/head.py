"""The language-modelling head over a split vocabulary (see `SplitTokenEmbedding`), with a chunked loss."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.models.blocks.embedding import check_segments, weight_of
from d9d.models.blocks.late_init import init_normal_
from d9d.models.blocks.loss import chunked_linear_cross_entropy
from d9d.parallel.tensor import vocab_parallel_cross_entropy, vocab_parallel_logits


class SplitLanguageModellingHead(nn.Module):
    """`segments.<name>.weight` `(size, hidden)` per vocabulary segment; logits are over their concatenation."""

    def __init__(
        self, segments: Mapping[str, int], hidden_size: int, *, init_std: float = 0.02, loss_chunk_size: int = 2048
    ) -> None:
        super().__init__()
        self.init_std = init_std
        self.loss_chunk_size = loss_chunk_size
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

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token float32 losses shaped like `labels` (0 where a label is -100); full logits without labels."""
        weight = self.weight()
        if isinstance(weight, DTensor):  # tensor parallel: this rank holds a slice of the vocabulary
            if labels is None:
                return vocab_parallel_logits(hidden, weight)
            return vocab_parallel_cross_entropy(hidden, weight, labels, chunk_size=self.loss_chunk_size)
        if labels is None:
            return self.logits(hidden)
        return chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=self.loss_chunk_size)
