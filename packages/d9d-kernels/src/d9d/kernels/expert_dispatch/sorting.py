"""Sorting token copies by expert: the one permutation behind the local MoE path and every dispatcher.

A token copy is a `(token, slot)` pair, flat index `token * k + slot`. Copies whose expert is `-1` (dropped by a
capacity limit) sort after every kept copy and are not part of any group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertOrder:
    """`order[j]`: flat copy index of sorted position `j` (kept copies first, by expert, stable); `inverse`
    undoes it; `group_sizes` `(E,)` kept copies per expert."""

    order: torch.Tensor
    inverse: torch.Tensor
    group_sizes: torch.Tensor


def sort_by_expert(expert_indices: torch.Tensor, num_experts: int, *, may_drop: bool = False) -> ExpertOrder:
    """Stable sort of the copies in `expert_indices` `(T, k)` (or flat) by expert.

    With `may_drop`, `-1` entries (dropped copies) sort last and count in no group; without it every entry must be
    a valid expert.
    """
    flat = expert_indices.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts)) if may_drop else flat
    order = torch.argsort(key, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    group_sizes = count_per_expert(key, num_experts + 1)[:num_experts]
    return ExpertOrder(order=order, inverse=inverse, group_sizes=group_sizes)


def count_per_expert(flat_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `flat_indices` (all in `[0, num_experts)`) name each expert, `(num_experts,)` int64.

    A scatter-add rather than `torch.bincount`, which on CUDA reads the maximum back to the host to size its output.
    """
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_indices.device)
    return counts.scatter_add_(0, flat_indices, torch.ones_like(flat_indices))


def gather_sorted_rows(x: torch.Tensor, sort: ExpertOrder, top_k: int, num_kept: int | None = None) -> torch.Tensor:
    """The first `num_kept` (default: all) copies of the tokens `x` `(T, H)` in sorted order, `(num_kept, H)`."""
    order = sort.order if num_kept is None else sort.order[:num_kept]
    return x[order // top_k]


def weighted_unsort(rows: torch.Tensor, sort: ExpertOrder, expert_weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `gather_sorted_rows` plus the combine: `sum_k w_k * row(token, k)`, dropped copies adding zero.

    `rows` are the kept copies in sorted order (their count tells how many were kept).
    """
    tokens, top_k = expert_weights.shape
    num_kept = rows.shape[0]
    if num_kept < tokens * top_k:  # one zero row stands in for every dropped copy
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
        inverse = sort.inverse.clamp(max=num_kept)
    else:
        inverse = sort.inverse
    by_slot = rows[inverse].view(tokens, top_k, rows.shape[-1])
    return (by_slot * expert_weights[..., None]).sum(dim=1)
