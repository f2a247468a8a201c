"""The grouped matmul interface: one linear layer per group of consecutive rows (the experts of an MoE layer)."""

from __future__ import annotations

from typing import Protocol

import torch


class GroupedMm(Protocol):
    """`out[rows of group e] = x[rows of group e] @ weight[e].T`.

    `x` is `(N, K)` with its rows sorted by group; `weight` is `(E, M, K)` (the `nn.Linear` layout, stacked);
    `group_sizes` is `(E,)` integer, summing to at most `N` (empty groups allowed). Returns `(N, M)` in `x`'s dtype.
    Differentiable with respect to `x` and `weight`.

    Rows past the sum of `group_sizes` are padding (the fixed-size buffer of `all_to_all_capacity`, design 0029): no
    group owns them, they are not computed and do not enter the weight gradient, and their output rows and
    input-gradient rows are unspecified (`torch`, `triton`: left unwritten; `eager`, `grouped_gemm`: zeros). A caller
    that pads must not read them.
    """

    name: str

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor: ...


def check_grouped(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> None:
    if x.ndim != 2 or weight.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"grouped matmul expects x (N, K), weight (E, M, K), group_sizes (E,); got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}, group_sizes {tuple(group_sizes.shape)}"
        )
    if weight.shape[0] != group_sizes.shape[0] or weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"grouped matmul: weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} and "
            f"{group_sizes.shape[0]} groups (need weight (E={group_sizes.shape[0]}, M, K={x.shape[1]}))"
        )
