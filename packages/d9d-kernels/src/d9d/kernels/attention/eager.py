"""The eager reference: explicit scores, float32 softmax. Slow and memory-hungry; the ground truth in tests."""

from __future__ import annotations

import torch

from d9d.kernels.attention.api import check_heads
from d9d.kernels.attention.mask import AttentionMask


class EagerAttention:
    """Scores in the input dtype, softmax in float32 (as Hugging Face's eager attention), then values."""

    name = "eager"

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: AttentionMask, scale: float
    ) -> torch.Tensor:
        groups = check_heads(query, key, value)
        q = query.transpose(1, 2)
        k = key.transpose(1, 2).repeat_interleave(groups, dim=1)
        v = value.transpose(1, 2).repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        allowed = mask.dense(query.shape[1], query.device)
        scores = scores.float()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(query.dtype)
        return torch.matmul(weights, v).transpose(1, 2)
