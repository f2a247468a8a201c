"""Token permutation: copies of each token, one per chosen expert, sorted by expert; and the way back.

The sort itself is d9d-kernels' `sort_by_expert`, shared with the expert-parallel dispatchers, so the local path and
the dispatched path order copies identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d9d.kernels.expert_dispatch import ExpertOrder, gather_sorted_rows, sort_by_expert, weighted_unsort


@dataclass(frozen=True)
class PermutedTokens:
    """`rows` `(kept copies, H)` sorted by expert, `group_sizes` `(E,)` rows per expert, and the bookkeeping to undo
    it (`sort.order[j]` is the flat `(token, slot)` index `token * k + slot` of sorted row `j`)."""

    rows: torch.Tensor
    group_sizes: torch.Tensor
    sort: ExpertOrder
    top_k: int


def permute_tokens(
    x: torch.Tensor, expert_indices: torch.Tensor, num_experts: int, *, may_drop: bool = False
) -> PermutedTokens:
    """Sort token copies by expert (stable: tokens keep their order within an expert).

    With `may_drop`, copies whose expert is `-1` (over a capacity limit) are left out (one host sync to count them).
    """
    sort = sort_by_expert(expert_indices, num_experts, may_drop=may_drop)
    num_kept = int(sort.group_sizes.sum()) if may_drop else None
    rows = gather_sorted_rows(x, sort, expert_indices.shape[1], num_kept)
    return PermutedTokens(rows=rows, group_sizes=sort.group_sizes, sort=sort, top_k=expert_indices.shape[1])


def unpermute_tokens(rows: torch.Tensor, permuted: PermutedTokens, expert_weights: torch.Tensor) -> torch.Tensor:
    """Weight each expert's output by its combine weight and sum a token's `k` outputs: `(T, H)`."""
    return weighted_unsort(rows, permuted.sort, expert_weights)
