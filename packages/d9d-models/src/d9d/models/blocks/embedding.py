"""Token embeddings over a vocabulary split into named, contiguous segments, each its own parameter.

E.g. `{"regular": 151643, "special": 293}`: ids `[0, 151643)` use `segments.regular.weight`, the rest
`segments.special.weight`, so the new special tokens can be trained (or frozen) on their own. One segment is the
ordinary embedding table.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional

from d9d.models.blocks.late_init import init_normal_


def check_segments(segments: Mapping[str, int]) -> dict[str, int]:
    if not segments or any(size <= 0 for size in segments.values()):
        raise ValueError(f"vocabulary segments must be a non-empty mapping of positive sizes, got {dict(segments)}")
    return dict(segments)


class SplitTokenEmbedding(nn.Module):
    def __init__(self, segments: Mapping[str, int], hidden_size: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.init_std = init_std
        self.segments = nn.ModuleDict(
            {name: nn.Embedding(size, hidden_size) for name, size in check_segments(segments).items()}
        )

    def segment_weights(self) -> dict[str, torch.Tensor]:
        """Each segment's `(size, hidden)` table, in vocabulary order."""
        return {name: weight_of(module) for name, module in self.segments.items()}

    def reset_parameters(self) -> None:
        for weight in self.segment_weights().values():
            init_normal_(weight, self.init_std)

    def weight(self) -> torch.Tensor:
        """The whole `(vocab, hidden)` table (a concatenation when there are several segments)."""
        weights = list(self.segment_weights().values())
        return weights[0] if len(weights) == 1 else torch.cat(weights)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return functional.embedding(input_ids, self.weight())


def weight_of(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight
