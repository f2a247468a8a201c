"""Expert parallelism over `all_to_all_single`: exchanged per-expert counts, variable splits, on gloo and NCCL.

dispatch: sort this rank's token copies by global expert (experts are contiguous per rank, so this also groups them
by destination), exchange the `(ranks, local experts)` count matrix, send the rows with variable splits, and reorder
what arrived from (source rank, local expert) to local-expert-major. combine: the same steps backwards, then the
combine weights on the rank that owns the tokens. One device-to-host copy per dispatch (both count matrices, into
pinned memory behind an event on CUDA); the rows to send are gathered after it is queued, so the device still works
when the host resumes. The host then derives the split lists, the local experts' group sizes and each `(source
rank, local expert)` block's offset in the local-expert-major order, so the reorder is a `repeat_interleave` of
64-odd offsets rather than a second sort (design 0025: the forward is host-bound, every launched op counts).
Every reordering is a gather whose backward is the inverse gather (`permute_rows`), never a scatter-add.
`dispatch` and `combine` never run under Dynamo (`eager_only`): see `TokenDispatcher`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from d9d.kernels.eager_only import eager_only
from d9d.kernels.expert_dispatch.api import DispatchedTokens, check_routing, mark_row_count_dynamic, split_experts
from d9d.kernels.expert_dispatch.sorting import (
    ExpertOrder,
    gather_sorted_rows,
    inverse_permutation,
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
    local_order: torch.Tensor | None  # None: the received order is already local-expert-major
    local_inverse: torch.Tensor | None


@dataclass(frozen=True)
class _ExchangePlan:
    """What the host derives from the `(ranks, local experts)` send and receive count matrices."""

    send_splits: list[int]
    recv_splits: list[int]
    block_delta: list[int]  # row-major `(r, e)`: target start (local-expert-major) minus received start
    group_sizes: list[int]  # rows per local expert
    num_received: int

    @staticmethod
    def from_counts(send: list[list[int]], recv: list[list[int]]) -> _ExchangePlan:
        num_ranks, num_local = len(recv), len(recv[0])
        received_start, cursor = [[0] * num_local for _ in range(num_ranks)], 0
        for r in range(num_ranks):
            for e in range(num_local):
                received_start[r][e], cursor = cursor, cursor + recv[r][e]
        delta, cursor = [0] * (num_ranks * num_local), 0
        for e in range(num_local):
            for r in range(num_ranks):
                delta[r * num_local + e], cursor = cursor - received_start[r][e], cursor + recv[r][e]
        return _ExchangePlan(
            send_splits=[sum(row) for row in send],
            recv_splits=[sum(row) for row in recv],
            block_delta=delta,
            group_sizes=[sum(recv[r][e] for r in range(num_ranks)) for e in range(num_local)],
            num_received=cursor,
        )


class AllToAllDispatcher:
    """`TokenDispatcher` over `group` (the `ep` ranks): rank `r` owns experts `[r * E/ep, (r + 1) * E/ep)`."""

    name = "all_to_all"
    traceable = False

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = split_experts(num_experts, self.num_ranks)
        # Rows this rank's experts received over every dispatch so far (known on the host for free): under EP the
        # busiest rank sets every rank's pace, so benchmarks compare it across ranks (routing imbalance).
        self.rows_received = 0

    @eager_only
    def dispatch(self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor) -> DispatchedTokens:
        check_routing(x, expert_indices, expert_weights)
        top_k = expert_indices.shape[1]
        sort = sort_by_expert(expert_indices, self.num_experts, may_drop=True)
        send_counts = sort.group_sizes.view(self.num_ranks, self.num_local_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        # The one host copy of the dispatch: both count matrices. The host derives everything else the exchange and
        # the local reorder need from them (split lists, block offsets, group sizes) instead of launching device ops.
        both = torch.cat([send_counts, recv_counts])
        if both.is_cuda:
            # Copied into pinned memory behind an event, so the host waits for the counts only: the gather of the
            # rows to send (queued after the copy) still runs while the host launches the exchange.
            staged = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            staged.copy_(both, non_blocking=True)
            counts_ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            counts_ready.record()
            copies = gather_sorted_rows(x, sort, top_k)  # every copy in sorted order, dropped ones last
            counts_ready.synchronize()
            counts = staged.tolist()
        else:
            copies = gather_sorted_rows(x, sort, top_k)
            counts = both.tolist()
        plan = _ExchangePlan.from_counts(counts[: self.num_ranks], counts[self.num_ranks :])
        self.rows_received += plan.num_received
        num_sent = sum(plan.send_splits)
        sent = copies if num_sent == copies.shape[0] else copies[:num_sent]  # a slice's backward would copy
        received = all_to_all(sent, plan.recv_splits, plan.send_splits, self.group)
        # Received rows are ordered by (source rank, local expert); the experts want local-expert-major. Row `i` of
        # block `(r, e)` moves by that block's offset `delta[r, e]`: no sort, one small host-to-device copy, from
        # pinned memory and non-blocking (a pageable copy would synchronise the stream: a second drain per layer).
        aux = torch.tensor(plan.block_delta + plan.group_sizes, dtype=torch.int64, pin_memory=x.is_cuda)
        aux = aux.to(x.device, non_blocking=True)
        num_blocks = len(plan.block_delta)
        local_order: torch.Tensor | None = None
        local_inverse: torch.Tensor | None = None
        rows = received
        if any(plan.block_delta):  # all zero with one rank or one local expert: nothing to reorder
            positions = torch.arange(plan.num_received, device=x.device)
            shift = torch.repeat_interleave(aux[:num_blocks], recv_counts.reshape(-1), output_size=plan.num_received)
            local_inverse = positions + shift
            local_order = inverse_permutation(local_inverse, positions)
            rows = permute_rows(received, local_order, local_inverse)
        handle = _AllToAllHandle(
            sort=sort,
            expert_weights=expert_weights,
            send_splits=plan.send_splits,
            recv_splits=plan.recv_splits,
            local_order=local_order,
            local_inverse=local_inverse,
        )
        return DispatchedTokens(rows=mark_row_count_dynamic(rows), group_sizes=aux[num_blocks:], handle=handle)

    @eager_only
    def combine(self, rows: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        handle = dispatched.handle
        assert isinstance(handle, _AllToAllHandle), "combine() needs the DispatchedTokens of this dispatcher"
        by_source = rows
        if handle.local_inverse is not None and handle.local_order is not None:
            by_source = permute_rows(rows, handle.local_inverse, handle.local_order)
        returned = all_to_all(by_source, handle.send_splits, handle.recv_splits, self.group)
        return weighted_unsort(returned, handle.sort, handle.expert_weights)
