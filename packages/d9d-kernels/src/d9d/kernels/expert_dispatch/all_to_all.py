"""Expert parallelism over `all_to_all_single`: exchanged per-expert counts, variable splits, on gloo and NCCL.

dispatch: sort this rank's token copies by global expert (experts are contiguous per rank, so this also groups them
by destination), exchange the `(ranks, local experts)` count matrix, send the rows with variable splits, and reorder
what arrived from (source rank, local expert) to local-expert-major. combine: the same steps backwards, then the
combine weights on the rank that owns the tokens. One device-to-host copy per dispatch (the split sizes); the rows
to send are gathered before it, so the device works while the host waits. Every reordering is a gather whose
backward is the inverse gather (`permute_rows`), never a scatter-add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from d9d.kernels.expert_dispatch.api import DispatchedTokens, check_routing, split_experts
from d9d.kernels.expert_dispatch.sorting import (
    ExpertOrder,
    gather_sorted_rows,
    permute_rows,
    sort_by_expert,
    weighted_unsort,
)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable splits; backward sends the gradients the opposite way."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _exchange(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable variable-split all-to-all of `rows` along dimension 0."""
    out = _AllToAll.apply(rows, output_splits, input_splits, group)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


@dataclass(frozen=True)
class _AllToAllHandle:
    sort: ExpertOrder
    expert_weights: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    local_order: torch.Tensor
    local_inverse: torch.Tensor


class AllToAllDispatcher:
    """`TokenDispatcher` over `group` (the `ep` ranks): rank `r` owns experts `[r * E/ep, (r + 1) * E/ep)`."""

    name = "all_to_all"

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = split_experts(num_experts, self.num_ranks)

    def dispatch(self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor) -> DispatchedTokens:
        check_routing(x, expert_indices, expert_weights)
        top_k = expert_indices.shape[1]
        sort = sort_by_expert(expert_indices, self.num_experts, may_drop=True)
        send_counts = sort.group_sizes.view(self.num_ranks, self.num_local_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        # Every copy in sorted order (dropped ones last): queued before the sync below, which it does not need.
        copies = gather_sorted_rows(x, sort, top_k)
        # One host copy for both split lists (they size the exchange and the received buffer).
        splits = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
        send_splits, recv_splits = [int(n) for n in splits[0]], [int(n) for n in splits[1]]
        num_sent = sum(send_splits)
        sent = copies if num_sent == copies.shape[0] else copies[:num_sent]  # a slice's backward would copy
        received = all_to_all(sent, recv_splits, send_splits, self.group)
        # Received rows are ordered by (source rank, local expert); the experts want local-expert-major.
        local_expert = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=x.device).repeat(self.num_ranks),
            recv_counts.reshape(-1),
            output_size=sum(recv_splits),  # known already: no second device-to-host sync
        )
        local_order = torch.argsort(local_expert, stable=True)
        local_inverse = torch.empty_like(local_order)
        local_inverse[local_order] = torch.arange(local_order.numel(), device=local_order.device)
        handle = _AllToAllHandle(
            sort=sort,
            expert_weights=expert_weights,
            send_splits=send_splits,
            recv_splits=recv_splits,
            local_order=local_order,
            local_inverse=local_inverse,
        )
        rows = permute_rows(received, local_order, local_inverse)
        return DispatchedTokens(rows=rows, group_sizes=recv_counts.sum(dim=0), handle=handle)

    def combine(self, rows: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        handle = dispatched.handle
        assert isinstance(handle, _AllToAllHandle), "combine() needs the DispatchedTokens of this dispatcher"
        by_source = permute_rows(rows, handle.local_inverse, handle.local_order)
        returned = all_to_all(by_source, handle.send_splits, handle.recv_splits, self.group)
        return weighted_unsort(returned, handle.sort, handle.expert_weights)
