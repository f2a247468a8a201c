"""MoE token permutation: the interface, the eager reference and the backends.

`sort_by_expert` turns the router's `(T, k)` expert indices into the bookkeeping (on the device, no host sync):
`order[j]` is the flat `(token, slot)` index `token * k + slot` of sorted row `j` (stable: tokens keep their order
within an expert), `inverse` undoes it, `group_sizes[e]` counts expert `e`'s rows. A kernel then moves the data:
`permute(x, order, top_k)` gathers `(T*k, H)` rows sorted by expert, `unpermute(rows, inverse, weights)` sums each
token's `k` expert outputs weighted by the router's combine weights.
"""

from __future__ import annotations

from typing import Protocol

import torch

from d9d.kernels.triton_support import any_dtensor


def sort_by_expert(expert_indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(order, inverse, group_sizes)` for `(T, k)` expert indices; `group_sizes` by a scatter-add (`bincount`
    would read the maximum back to the host)."""
    flat = expert_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    group_sizes = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    group_sizes.scatter_add_(0, flat, torch.ones_like(flat))
    return order, inverse, group_sizes


class MoePermuteKernel(Protocol):
    """Moves token rows to expert order and back; differentiable in `x`, `rows` and `weights`."""

    name: str

    def permute(self, x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
        """`x[order // top_k]`: `(T, H)` -> `(T*k, H)` sorted by expert."""
        ...

    def unpermute(self, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`sum_s weights[t, s] * rows[inverse[t*k + s]]`: `(T*k, H)` -> `(T, H)` for `weights` `(T, k)`."""
        ...


class EagerMoePermute:
    """Indexing and a weighted sum in PyTorch: any device and dtype; the reference."""

    name = "eager"

    def permute(self, x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
        return x[order // top_k]

    def unpermute(self, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = weights.shape
        by_slot = rows[inverse].view(tokens, top_k, rows.shape[-1])
        return (by_slot * weights[..., None]).sum(dim=1)


class TritonMoePermute:
    """Row gathers and a fused weighted combine in Triton (custom ops in `d9d.kernels.moe_permute.ops`), no atomics:
    every backward is a gather too, so results are deterministic. Imports Triton when built."""

    name = "triton"

    def __init__(self) -> None:
        from d9d.kernels.triton_support import import_triton

        import_triton()
        from d9d.kernels.moe_permute import ops

        self._ops = ops

    def permute(self, x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
        if any_dtensor(x):
            return EagerMoePermute().permute(x, order, top_k)
        return self._ops.permute(x, order, top_k)

    def unpermute(self, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if any_dtensor(rows, weights):
            return EagerMoePermute().unpermute(rows, inverse, weights)
        return self._ops.unpermute(rows, inverse, weights)
