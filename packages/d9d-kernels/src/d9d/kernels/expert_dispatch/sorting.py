"""Sorting token copies by expert: the one permutation behind the local MoE path and every dispatcher.

A token copy is a `(token, slot)` pair, flat index `token * k + slot`. Copies whose expert is `-1` (dropped by a
capacity limit) sort after every kept copy and are not part of any group.

Every row movement here is a gather whose backward is a gather too: the sort is a permutation whose inverse is kept,
so the gradient of `rows[index]` is `grad[inverse]` rather than autograd's default scatter-add (`index_put_` with
accumulation, which on CUDA sorts the indices and accumulates serially per duplicate). A token's `k` copies are
summed in their slot order, with no atomics, so gradients are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    # -1 mod (E + 1) == E: dropped copies get the key after every expert, in one elementwise op.
    key = flat.remainder(num_experts + 1) if may_drop else flat
    order = torch.argsort(key, stable=True)
    inverse = inverse_permutation(order)
    group_sizes = count_per_expert(key, num_experts + 1)[:num_experts]
    return ExpertOrder(order=order, inverse=inverse, group_sizes=group_sizes)


def inverse_permutation(order: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """`inverse[order[j]] == j`, one scatter (cheaper to launch than `inverse[order] = arange`, an `index_put_`);
    `positions`: `arange(len(order))` where the caller has it already."""
    if positions is None:
        positions = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return torch.empty_like(order).scatter_(0, order, positions)


def count_per_expert(flat_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `flat_indices` (all in `[0, num_experts)`) name each expert, `(num_experts,)` int64.

    A scatter-add rather than `torch.bincount`, which on CUDA reads the maximum back to the host to size its output.
    """
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_indices.device)
    return counts.scatter_add_(0, flat_indices, torch.ones_like(flat_indices))


class _PermuteRows(torch.autograd.Function):
    """`rows[index]` for a permutation `index` with known `inverse`: the backward is the inverse gather."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`rows[index]` (`index` a permutation of the rows, `inverse[index[j]] == j`), differentiable by gathers."""
    out = _PermuteRows.apply(rows, index, inverse)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


def _padded_inverse(inverse: torch.Tensor, num_kept: int) -> torch.Tensor:
    """`inverse` with every dropped copy (sorted position `>= num_kept`) pointing at one extra zero row."""
    return inverse if num_kept == inverse.numel() else inverse.clamp(max=num_kept)


def _append_zero_row(rows: torch.Tensor, num_kept: int, total: int) -> torch.Tensor:
    return rows if num_kept == total else torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])


class _GatherCopies(torch.autograd.Function):
    """`x[order[:num_kept] // k]`; backward sums each token's `k` copy gradients (dropped ones are zero)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sort: ExpertOrder, top_k: int, num_kept: int) -> torch.Tensor:
        ctx.sort, ctx.top_k, ctx.num_kept = sort, top_k, num_kept
        return x.index_select(0, sort.order[:num_kept] // top_k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        total = ctx.sort.inverse.numel()
        padded = _append_zero_row(grad, ctx.num_kept, total)
        by_slot = padded.index_select(0, _padded_inverse(ctx.sort.inverse, ctx.num_kept))
        return by_slot.view(total // ctx.top_k, ctx.top_k, grad.shape[-1]).sum(dim=1), None, None, None


class _UnsortCopies(torch.autograd.Function):
    """The kept copies `(num_kept, H)` in sorted order back to flat `(token, slot)` order `(T * k, H)`, zero rows
    for dropped copies; backward gathers the kept copies' gradients in sorted order."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sort: ExpertOrder) -> torch.Tensor:
        ctx.sort, ctx.num_kept = sort, rows.shape[0]
        total = sort.inverse.numel()
        return _append_zero_row(rows, ctx.num_kept, total).index_select(0, _padded_inverse(sort.inverse, ctx.num_kept))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.index_select(0, ctx.sort.order[: ctx.num_kept]), None


def gather_sorted_rows(x: torch.Tensor, sort: ExpertOrder, top_k: int, num_kept: int | None = None) -> torch.Tensor:
    """The first `num_kept` (default: all) copies of the tokens `x` `(T, H)` in sorted order, `(num_kept, H)`."""
    kept = sort.order.numel() if num_kept is None else num_kept
    out = _GatherCopies.apply(x, sort, top_k, kept)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


def weighted_unsort(rows: torch.Tensor, sort: ExpertOrder, expert_weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `gather_sorted_rows` plus the combine: `sum_k w_k * row(token, k)`, dropped copies adding zero.

    `rows` are the kept copies in sorted order (their count tells how many were kept).
    """
    tokens, top_k = expert_weights.shape
    flat = _UnsortCopies.apply(rows, sort)  # type: ignore[no-untyped-call]
    assert isinstance(flat, torch.Tensor)
    by_slot = flat.view(tokens, top_k, rows.shape[-1])
    return (by_slot * expert_weights[..., None]).sum(dim=1)
