"""Token permutation: copies of each token, one per chosen expert, sorted by expert; and the way back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def permute_tokens(x: torch.Tensor, expert_indices: torch.Tensor, num_experts: int) -> PermutedTokens:
    """Sort token copies by expert (stable: tokens keep their order within an expert)."""
    top_k = expert_indices.shape[1]
    flat = expert_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    group_sizes = torch.bincount(flat, minlength=num_experts)
    return PermutedTokens(rows=x[order // top_k], group_sizes=group_sizes, order=order, inverse=inverse, top_k=top_k)


def unpermute_tokens(rows: torch.Tensor, permuted: PermutedTokens, expert_weights: torch.Tensor) -> torch.Tensor:
    """Weight each expert's output by its combine weight and sum a token's `k` outputs: `(T, H)`."""
    tokens = expert_weights.shape[0]
    by_slot = rows[permuted.inverse].view(tokens, permuted.top_k, rows.shape[-1])
    return (by_slot * expert_weights[..., None]).sum(dim=1)
