"""A sync-free expert-parallel exchange: every (source rank, destination rank) pair moves a fixed `C` rows.

`C = round_up(ceil(capacity_factor * T * k / ep), CAPACITY_ALIGNMENT)`, the same on every rank (every rank of the
group must dispatch the same number of tokens `T`, i.e. one micro-batch shape; asserted on the device). Because the
splits are equal and known from shapes alone, no count ever reaches the host: no `.tolist()`, `.item()`, `nonzero`
or data-dependent shape in dispatch, combine or their backward, so the GPU queue never drains at an MoE layer (design
0029; the all-to-all dispatcher drains it once per layer, design 0025). The collectives are functional
(`all_to_all_single[_autograd]` with no split lists), which `torch.compile` traces.

Dropping: a copy is sent when it is one of the first `C` copies (in flat `(token, slot)` order) that this rank routes
to that destination rank; the later ones are dropped: they contribute zero to `combine` and get zero gradient, like
the MoE layer's per-expert capacity dropping. `dropped_copies` counts them (a device tensor, summed over dispatches).

Layout: rank `r` sends `ep` blocks of `C` rows; block `d` holds the copies for rank `d` sorted by local expert (stable,
so in token order within an expert), then zero padding rows. The receiver reorders what arrived to local-expert-major
(expert, then source rank, then token order: the all-to-all dispatcher's order exactly), padding rows last. The
group sizes stay on the device and sum to the valid rows only: the padding rows after them belong to no group, so
the grouped matmuls skip them (`GroupedMm`: rows past the sum are padding, not computed, and excluded from the
weight gradient), and `combine` and the backward of `dispatch` never read them, so whatever the experts leave there
adds nothing to any result or gradient (design 0029).

Every row movement is a gather whose backward is a gather (no scatter-add), so gradients are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from d9d.kernels.expert_dispatch.api import DispatchedTokens, check_routing, split_experts
from d9d.kernels.expert_dispatch.sorting import count_per_expert, inverse_permutation, permute_rows

# Rows per (source, destination) block are a multiple of this: every block starts on a 16-row boundary of the
# exchanged buffer (a whole bf16 tile of the grouped GEMMs' row blocks; 16 x H x 2 bytes keeps NCCL's chunks aligned).
CAPACITY_ALIGNMENT = 16
DEFAULT_CAPACITY_FACTOR = 2.0


def check_capacity_factor(capacity_factor: float) -> None:
    if not (isinstance(capacity_factor, int | float) and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(
            f"capacity_factor must be a finite number > 0 (rows per destination rank over the mean T * k / ep); "
            f"got capacity_factor={capacity_factor!r}"
        )


def round_up_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of `CAPACITY_ALIGNMENT`."""
    return -(-rows // CAPACITY_ALIGNMENT) * CAPACITY_ALIGNMENT


def pair_capacity(num_tokens: int, top_k: int, num_ranks: int, capacity_factor: float) -> int:
    """`C`: rows each rank sends to each rank, `round_up(ceil(capacity_factor * T * k / ep), CAPACITY_ALIGNMENT)`."""
    check_capacity_factor(capacity_factor)
    return round_up_rows(math.ceil(capacity_factor * num_tokens * top_k / num_ranks))


class _GatherToSlots(torch.autograd.Function):
    """Send buffer `(ep * C, H)`: slot `s` holds token `slot_token[s]` (`T`: an empty slot, a zero row). Backward
    sums each token's `k` copy gradients in slot order, read from `slot_of_copy` (`ep * C`: dropped, zero; the
    gradient of an empty slot is never read, so whatever the experts left in padding rows stays out)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, slot_token: torch.Tensor, slot_of_copy: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(slot_of_copy)
        ctx.top_k = top_k
        return torch.cat([x, x.new_zeros(1, x.shape[-1])]).index_select(0, slot_token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (slot_of_copy,) = ctx.saved_tensors
        by_copy = _read_slots(grad, slot_of_copy)
        return by_copy.view(-1, ctx.top_k, grad.shape[-1]).sum(dim=1), None, None, None


def _read_slots(rows: torch.Tensor, slot_of_copy: torch.Tensor) -> torch.Tensor:
    """`rows[slot_of_copy]` with zero rows for dropped copies (`slot_of_copy == len(rows)`): a gather and a select
    over the `T * k` copies, cheaper than appending a zero row to the `ep * C` rows; `where`, not a product, so a
    non-finite value in an unread padding row cannot leak in."""
    num_slots = rows.shape[0]
    gathered = rows.index_select(0, slot_of_copy.clamp(max=max(num_slots - 1, 0)))
    return torch.where((slot_of_copy < num_slots)[:, None], gathered, 0.0)


class _GatherFromSlots(torch.autograd.Function):
    """Per copy `(T * k, H)`: the returned row of its slot, a zero row for a dropped copy. Backward: slot `s` gets
    the gradient of copy `slot_copy[s]` (`T * k`: an empty slot, zero)."""

    @staticmethod
    def forward(ctx: Any, returned: torch.Tensor, slot_of_copy: torch.Tensor, slot_copy: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_copy)
        return _read_slots(returned, slot_of_copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slot_copy,) = ctx.saved_tensors
        return torch.cat([grad, grad.new_zeros(1, grad.shape[-1])]).index_select(0, slot_copy), None, None


def _exchange(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-split all-to-all of `rows` along dimension 0, differentiable (backward: the same exchange)."""
    return _wait(funcol.all_to_all_single_autograd(rows.contiguous(), None, None, group))


def token_count_mismatch_message(num_tokens: int) -> str:
    """The device assert's message when the group's ranks dispatch different token counts.

    CUDA's `_assert_async` refuses messages of 255 characters or more (gloo does not), so this stays short.
    """
    return (
        f"all_to_all_capacity: this rank dispatches T={num_tokens} tokens and another rank of the expert-parallel "
        "group a different T; use one micro-batch shape on every rank, or the all_to_all dispatcher"
    )


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for on the stream (no host sync; a no-op once waited)."""
    out: torch.Tensor = funcol.wait_tensor(tensor)  # type: ignore[no-untyped-call]  # untyped in torch
    return out


@dataclass(frozen=True)
class _CapacityHandle:
    slot_of_copy: torch.Tensor  # (T * k,): send slot of each copy, `ep * C` when dropped
    slot_copy: torch.Tensor  # (ep * C,): copy in each send slot, `T * k` when empty
    local_order: torch.Tensor  # local-expert-major position -> received position
    local_inverse: torch.Tensor
    expert_weights: torch.Tensor


@dataclass(frozen=True)
class _SendPlan:
    slot_of_copy: torch.Tensor
    slot_copy: torch.Tensor
    send_counts: torch.Tensor  # (ep, E_local) copies sent per destination rank and local expert
    dropped: torch.Tensor  # () copies over capacity


def _plan_sends(
    expert_indices: torch.Tensor, num_experts: int, num_ranks: int, num_local: int, capacity: int
) -> _SendPlan:
    flat = expert_indices.reshape(-1).long()  # gathers below index with it
    num_copies = flat.numel()
    routed = flat >= 0
    dest = torch.where(routed, flat.div(num_local, rounding_mode="floor"), num_ranks)  # `ep`: goes nowhere
    # Rank of each copy among this rank's copies to the same destination, in (token, slot) order: a running count
    # per destination, laid out (destination, copy) so that the scan runs along contiguous memory (a scan along
    # dimension 0 of a (copies, ep + 1) matrix runs one serial thread per column: tens of ms on a GPU).
    match = dest[None, :] == torch.arange(num_ranks + 1, device=flat.device)[:, None]
    position = match.cumsum(dim=1).gather(0, dest[None, :]).squeeze(0) - 1
    sent = routed & (position < capacity)
    dropped = (routed & ~sent).sum()
    # Sent copies sorted by global expert (destination-major, local expert within), stable: token order within.
    key = torch.where(sent, flat, num_experts)
    order = torch.argsort(key, stable=True)
    sorted_position = inverse_permutation(order)
    send_counts = count_per_expert(key, num_experts + 1)[:num_experts].view(num_ranks, num_local)
    per_dest = send_counts.sum(dim=1)
    dest_start = per_dest.cumsum(0) - per_dest
    dest_start_ext = torch.cat([dest_start, dest_start.new_zeros(1)])
    slot_of_copy = torch.where(
        sent, dest * capacity + sorted_position - dest_start_ext[dest], torch.full_like(flat, num_ranks * capacity)
    )
    # Slot (d, j) holds sorted copy `dest_start[d] + j` while `j < per_dest[d]`; a gather, so no duplicate writes.
    j = torch.arange(capacity, device=flat.device)
    filled = j[None, :] < per_dest[:, None]
    order_ext = torch.cat([order, order.new_full((1,), num_copies)])
    source = (dest_start[:, None] + j[None, :]).clamp(max=num_copies)
    slot_copy = torch.where(filled, order_ext[source], num_copies).reshape(-1)
    return _SendPlan(slot_of_copy=slot_of_copy, slot_copy=slot_copy, send_counts=send_counts, dropped=dropped)


def _local_reorder(recv_counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the received `(ep, C)` blocks (rows by local expert, then padding): each row's position in the
    local-expert-major order (expert, source rank, arrival), padding rows last in arrival order; and the per-expert
    row counts. All on the device."""
    num_ranks, _ = recv_counts.shape
    in_block_end = recv_counts.cumsum(dim=1)  # (ep, E_local)
    block_valid = in_block_end[:, -1]  # rows that arrived from each source
    j = torch.arange(capacity, device=recv_counts.device).expand(num_ranks, capacity).contiguous()
    expert = torch.searchsorted(in_block_end, j, right=True).clamp(max=recv_counts.shape[1] - 1)
    within = j - (in_block_end - recv_counts).gather(1, expert)
    group_sizes = recv_counts.sum(dim=0)
    group_start = group_sizes.cumsum(0) - group_sizes
    from_earlier_sources = recv_counts.cumsum(dim=0) - recv_counts  # (ep, E_local)
    target_valid = group_start[expert] + from_earlier_sources.gather(1, expert) + within
    num_valid = group_sizes.sum()
    ranks = torch.arange(num_ranks, device=recv_counts.device)
    valid_before = block_valid.cumsum(0) - block_valid
    pad_index = (ranks * capacity - valid_before)[:, None] + (j - block_valid[:, None])
    target = torch.where(j < block_valid[:, None], target_valid, num_valid + pad_index)
    return target.reshape(-1), group_sizes


class AllToAllCapacityDispatcher:
    """`TokenDispatcher` over `group` with a static capacity `C` per (source, destination) rank pair: no host sync.

    `capacity_factor` sets `C` relative to the mean `T * k / ep` (see `pair_capacity`); copies beyond it are dropped
    (module docstring). `dropped_copies` and `rows_received` are device tensors summed over every dispatch
    (recomputations under activation checkpointing included); read them when logging, not every step.
    """

    name = "all_to_all_capacity"
    traceable = True

    def __init__(
        self, group: dist.ProcessGroup, num_experts: int, capacity_factor: float = DEFAULT_CAPACITY_FACTOR
    ) -> None:
        check_capacity_factor(capacity_factor)
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = split_experts(num_experts, self.num_ranks)
        self.capacity_factor = capacity_factor
        # Created here, not at the first dispatch: a compiled caller would otherwise guard on `None` and recompile.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        self.dropped_copies = torch.zeros((), dtype=torch.int64, device=device)
        self.rows_received = torch.zeros((), dtype=torch.int64, device=device)

    def capacity(self, num_tokens: int, top_k: int) -> int:
        return pair_capacity(num_tokens, top_k, self.num_ranks, self.capacity_factor)

    def dispatch(self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor) -> DispatchedTokens:
        check_routing(x, expert_indices, expert_weights)
        num_tokens, top_k = expert_indices.shape
        capacity = self.capacity(num_tokens, top_k)
        plan = _plan_sends(expert_indices, self.num_experts, self.num_ranks, self.num_local_experts, capacity)
        slot_token = plan.slot_copy.div(top_k, rounding_mode="floor")  # `T` for an empty slot: the zero row
        send = _GatherToSlots.apply(x, slot_token, plan.slot_of_copy, top_k)  # type: ignore[no-untyped-call]
        # Each destination's counts travel with this rank's token count: `C` derives from `T`, so a rank whose `T`
        # differs would send blocks of another size and the exchange below would hang (NCCL) or fail obscurely.
        tokens = plan.send_counts.new_full((self.num_ranks, 1), num_tokens)
        exchanged = _wait(
            funcol.all_to_all_single(torch.cat([plan.send_counts, tokens], dim=1).reshape(-1), None, None, self.group)
        ).view(self.num_ranks, self.num_local_experts + 1)
        torch._assert_async((exchanged[:, -1] == num_tokens).all(), token_count_mismatch_message(num_tokens))
        recv_counts = exchanged[:, :-1]
        received = _exchange(send, self.group)
        local_inverse, group_sizes = _local_reorder(recv_counts, capacity)
        local_order = inverse_permutation(local_inverse)
        rows = permute_rows(received, local_order, local_inverse)
        self._accumulate(plan.dropped, group_sizes.sum())
        handle = _CapacityHandle(
            slot_of_copy=plan.slot_of_copy,
            slot_copy=plan.slot_copy,
            local_order=local_order,
            local_inverse=local_inverse,
            expert_weights=expert_weights,
        )
        return DispatchedTokens(rows=rows, group_sizes=group_sizes, handle=handle)

    def combine(self, rows: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        handle = dispatched.handle
        assert isinstance(handle, _CapacityHandle), "combine() needs the DispatchedTokens of this dispatcher"
        by_source = permute_rows(rows, handle.local_inverse, handle.local_order)
        returned = _exchange(by_source, self.group)
        per_copy = _GatherFromSlots.apply(returned, handle.slot_of_copy, handle.slot_copy)  # type: ignore[no-untyped-call]
        tokens, top_k = handle.expert_weights.shape
        by_slot = per_copy.view(tokens, top_k, rows.shape[-1])
        out: torch.Tensor = (by_slot * handle.expert_weights[..., None]).sum(dim=1)
        return out

    def _accumulate(self, dropped: torch.Tensor, received: torch.Tensor) -> None:
        # Reassigned, not updated in place: compiled callers trace an attribute store, not a mutation.
        self.dropped_copies = self.dropped_copies + dropped.detach()
        self.rows_received = self.rows_received + received.detach()
