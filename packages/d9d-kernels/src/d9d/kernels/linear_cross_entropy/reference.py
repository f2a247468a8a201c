"""PyTorch per-chunk math for the chunk driver (the eager backend), and the full-logits reference."""

from __future__ import annotations

import torch
from torch.nn import functional

from d9d.kernels.linear_cross_entropy.chunks import IGNORE_INDEX


def _local_targets(targets: torch.Tensor, vocab_start: int, shard_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = targets - vocab_start
    inside = (local >= 0) & (local < shard_size) & (targets != IGNORE_INDEX)
    return local.clamp(0, shard_size - 1), inside


class TorchChunkMath:
    """The two per-chunk steps as PyTorch ops (float32 softmax statistics, as `torch.logsumexp`)."""

    def stats(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values = logits.float()
        maximum = values.amax(dim=-1)
        sum_exp = torch.exp(values - maximum[:, None]).sum(dim=-1)
        local, inside = _local_targets(targets, vocab_start, values.shape[-1])
        target = torch.where(inside, values.gather(1, local[:, None]).squeeze(1), 0.0)
        return maximum, sum_exp, target

    def gradient(
        self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, vocab_start: int
    ) -> torch.Tensor:
        probs = torch.exp(logits.float() - lse[:, None])
        local, inside = _local_targets(targets, vocab_start, probs.shape[-1])
        probs.scatter_add_(1, local[:, None], -inside.float()[:, None])
        return (probs * scale[:, None]).to(logits.dtype)

    def stats_and_gradient(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        maximum, sum_exp, target = self.stats(logits, targets, 0)
        scale = (targets != IGNORE_INDEX).float()
        return maximum, sum_exp, target, self.gradient(logits, targets, maximum + torch.log(sum_exp), scale, 0)


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token losses through the full float32 logits: the simplest statement of what the chunked paths compute."""
    logits = (hidden @ weight.T).float()
    return functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
