"""The token dispatcher interface: move routed token copies to the ranks that own their experts, and back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DispatchedTokens:
    """What this rank's local experts receive: `rows` `(N, H)` sorted by local expert, `group_sizes` `(E_local,)`
    summing to at most `N`. A fixed-size exchange (`all_to_all_capacity`) ends `rows` with padding rows (zeros)
    after the last group; the grouped matmuls skip them (`GroupedMm`) and `combine` never reads their outputs, so
    they add nothing to any result or gradient.

    `handle` is the implementation's bookkeeping to bring the rows back in `combine`; treat it as opaque.
    """

    rows: torch.Tensor
    group_sizes: torch.Tensor
    handle: object


class TokenDispatcher(Protocol):
    """Expert-parallel token exchange over the `ep` ranks of one group, experts split evenly and contiguously.

    `dispatch(x (T, H), expert_indices (T, k), expert_weights (T, k))`: each token copy goes to the rank that owns
    its expert (global index; `-1` marks a copy dropped by a capacity limit, which goes nowhere). `combine(rows,
    dispatched)`: the expert outputs (same order as `dispatched.rows`) come back, are weighted by the combine weights
    and summed per token, `(T, H)`. Both are differentiable (rows, `x` and the combine weights).

    Under `torch.compile` the all-to-all and DeepEP dispatchers' `dispatch` and `combine` are graph breaks
    (`eager_only`, i.e. `torch.compiler.disable`): they copy counts to
    the host and pass them to collectives as Python lists, which Dynamo would bake into guards (a recompilation for
    every new routing). Code compiled between them sees `rows` with a dynamic first dimension
    (`mark_row_count_dynamic`), so it compiles once for every row count. `all_to_all_capacity` has static shapes and
    no host copy, so Dynamo traces it (functional collectives).
    """

    name: str
    num_local_experts: int
    # True where `dispatch` and `combine` compile without a graph break (static shapes, no host copy): a compiled
    # caller (the MoE layer) may then trace them instead of keeping the exchange eager.
    traceable: bool

    def dispatch(
        self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor
    ) -> DispatchedTokens: ...

    def combine(self, rows: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor: ...


def check_routing(x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor) -> None:
    if x.ndim != 2 or expert_indices.ndim != 2 or expert_weights.shape != expert_indices.shape:
        raise ValueError(
            f"dispatch expects x (T, H), expert_indices (T, k) and expert_weights (T, k); got x {tuple(x.shape)}, "
            f"expert_indices {tuple(expert_indices.shape)}, expert_weights {tuple(expert_weights.shape)}"
        )
    if expert_indices.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens but expert_indices has {expert_indices.shape[0]} rows")


def split_experts(num_experts: int, num_ranks: int) -> int:
    """Experts per rank; raises when `num_experts` does not split evenly over `num_ranks`."""
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the expert-parallel degree ep={num_ranks}; valid ep: "
            + ", ".join(str(d) for d in range(1, num_experts + 1) if num_experts % d == 0)
        )
    return num_experts // num_ranks


def mark_row_count_dynamic(rows: torch.Tensor) -> torch.Tensor:
    """`rows`, marked so that code compiled after a dispatch treats its length as symbolic from the first compile
    (it depends on the routing) rather than specialising on it and recompiling when it changes. A no-op in eager
    execution (it sets an attribute)."""
    torch._dynamo.maybe_mark_dynamic(rows, 0)
    return rows
