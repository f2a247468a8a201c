"""Token permutation: copies of each token, one per chosen expert, sorted by expert; and the way back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d9d.kernels.moe_permute import EagerMoePermute, MoePermuteKernel, sort_by_expert

EAGER_PERMUTE = EagerMoePermute()


@dataclass(frozen=True)
class PermutedTokens:
    """`rows` `(T*k, H)` sorted by expert, `group_sizes` `(E,)` rows per expert, and the bookkeeping to undo it.

    `order[j]` is the flat `(token, slot)` index (`token * k + slot`) of sorted row `j`; `inverse` undoes it.
    """

    rows: torch.Tensor
    group_sizes: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    top_k: int


def permute_tokens(
    x: torch.Tensor, expert_indices: torch.Tensor, num_experts: int, kernel: MoePermuteKernel = EAGER_PERMUTE
) -> PermutedTokens:
    """Sort token copies by expert (stable: tokens keep their order within an expert); the counts stay on the
    device (no host sync)."""
    top_k = expert_indices.shape[1]
    order, inverse, group_sizes = sort_by_expert(expert_indices, num_experts)
    rows = kernel.permute(x, order, top_k)
    return PermutedTokens(rows=rows, group_sizes=group_sizes, order=order, inverse=inverse, top_k=top_k)


def unpermute_tokens(
    rows: torch.Tensor,
    permuted: PermutedTokens,
    expert_weights: torch.Tensor,
    kernel: MoePermuteKernel = EAGER_PERMUTE,
) -> torch.Tensor:
    """Weight each expert's output by its combine weight and sum a token's `k` outputs: `(T, H)`."""
    return kernel.unpermute(rows, permuted.inverse, expert_weights)
