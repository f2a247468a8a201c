"""A sync-free expert-parallel exchange that sends each token once per destination rank (design 0031).

`all_to_all_capacity` (design 0029) moves one row per routed copy and pads every (source, destination) block to
`C = 2 T k / ep` rows: with top-8 routing over 4 ranks that is 4 x 2 x T rows each way per exchange, of which the
copies fill half. Here a token travels once to each rank that owns at least one of its experts, with its local
expert ids and combine weights; the receiver expands it to its copies, runs its experts, and sends back one row per
token: the weighted sum of its local experts' outputs. The sender adds the rows that come back. A block then holds at
most `T` rows (a token goes to a rank once), so `C = round_up(ceil(token_capacity_factor * T), 16)`, and at the
default factor 1.0 nothing is ever dropped on the way. With top-8 over 64 experts on 4 ranks a token needs 3.6 ranks
on average, so the rows moved per exchange fall from `8 T` (the padded copies) to `4 T` at most, `3.6 T` of them
real (DeepEP's dispatch deduplicates the same way).

The receiver's experts see a fixed buffer of `M = round_up(ceil(copy_capacity_factor * T * k), 16)` rows sorted
by local expert (expert, then source rank, then token order: the all-to-all dispatcher's order), padding last; the
group sizes stay on the device and sum to the kept copies (the grouped matmuls skip the padding, design 0029). A
rank whose experts are routed more than `M` copies drops the latest ones in that order; with `copy_capacity_factor`
at `ep` nothing can be dropped (`ep` sources send at most `T k` copies each). `dropped_copies` counts both kinds of
drop (a device tensor, summed over dispatches), `rows_received` the kept copies.

No host sync and static shapes: every count stays on the device, the exchanges are functional collectives with
equal splits, so the whole layer can be captured in a CUDA graph (`d9d.core.loop.CudaGraphedStep`) or compiled.
Every row movement is a gather whose backward is a gather: a token's partial sums are added in destination order
and a slot's copies in slot order, so results and gradients are deterministic. The combine weights travel as float32
and the partial sums are accumulated in float32 and sent in the expert outputs' dtype, so the result differs from
the all-to-all dispatcher's by that one rounding of each partial sum (bfloat16: about 2^-9 relative).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from d9d.kernels.expert_dispatch.api import DispatchedTokens, check_routing, split_experts
from d9d.kernels.expert_dispatch.capacity import _exchange, _wait, round_up_rows, token_count_mismatch_message
from d9d.kernels.expert_dispatch.sorting import count_per_expert, inverse_permutation
from d9d.kernels.triton_support import triton_importable

DEFAULT_TOKEN_CAPACITY_FACTOR = 1.0
DEFAULT_COPY_CAPACITY_FACTOR = 2.0


def check_token_capacity_factors(token_capacity_factor: float, copy_capacity_factor: float) -> None:
    ok = isinstance(token_capacity_factor, int | float) and math.isfinite(token_capacity_factor)
    if not (ok and 0 < token_capacity_factor <= 1):
        raise ValueError(
            "token_capacity_factor must be in (0, 1] (tokens each rank sends each rank, over the tokens T; 1.0 never "
            f"drops); got token_capacity_factor={token_capacity_factor!r}"
        )
    ok = isinstance(copy_capacity_factor, int | float) and math.isfinite(copy_capacity_factor)
    if not (ok and copy_capacity_factor > 0):
        raise ValueError(
            "copy_capacity_factor must be a finite number > 0 (expert rows per rank over the mean T * k; ep never "
            f"drops); got copy_capacity_factor={copy_capacity_factor!r}"
        )


def token_pair_capacity(num_tokens: int, token_capacity_factor: float) -> int:
    """`C`: token rows each rank sends each rank, `round_up(ceil(token_capacity_factor * T), 16)`."""
    return round_up_rows(math.ceil(token_capacity_factor * num_tokens))


def expert_row_capacity(num_tokens: int, top_k: int, num_ranks: int, copy_capacity_factor: float) -> int:
    """`M`: expert input rows per rank, `round_up(ceil(copy_capacity_factor * T * k), 16)`, at most every copy the
    `ep` sources could send."""
    return min(round_up_rows(math.ceil(copy_capacity_factor * num_tokens * top_k)), num_ranks * num_tokens * top_k)


@dataclass(frozen=True)
class _ExpertRows:
    copy_row: torch.Tensor  # (ep * C, k): expert row of each received copy, `M` when none or dropped
    kept_copy: torch.Tensor  # (M,): received copy `slot * k + j` of each expert row (padding rows: any)
    num_kept: torch.Tensor  # (): kept copies, the expert rows before the padding


@dataclass(frozen=True)
class _TokenHandle:
    token_slots: torch.Tensor  # (T, ep): send slot of each token per destination, `ep * C` when not sent
    slot_token: torch.Tensor  # (ep * C,): token in each send slot, `T` when empty
    received_weights: torch.Tensor  # (ep * C, k) float32: combine weights of the received slots' local copies
    rows: _ExpertRows
    weights_dtype: torch.dtype


class _TokensToSlots(torch.autograd.Function):
    """Send buffer `(ep * C, H)`: slot `s` holds token `slot_token[s]` (`T`: empty, a zero row). Backward: each
    token's gradient is the sum, in destination order, of its slots' (`token_slots` `(T, ep)`, `ep * C`: not sent)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slot_token: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token_slots)
        return torch.cat([x, x.new_zeros(1, x.shape[-1])]).index_select(0, slot_token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (token_slots,) = ctx.saved_tensors
        return gather_sum(grad, token_slots), None, None


def gather_sum(
    rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`(O, H)` in `dtype` (default `rows.dtype`): `out[o] = sum_j weights[o, j] * rows[index[o, j]]` over the `j`
    with `index[o, j] < len(rows)` (the others are "none"), accumulated in float32 in `j` order: deterministic. One
    Triton kernel on a GPU (the MoE permutation's combine, masked); elsewhere one gather per column `j`, no
    `(O, K, H)` intermediate."""
    dtype = dtype or rows.dtype
    if rows.is_cuda and triton_importable():
        return triton_gather_sum(rows, index, weights, dtype)
    num_rows = rows.shape[0]
    total = torch.zeros(index.shape[0], rows.shape[-1], dtype=torch.float32, device=rows.device)
    for j in range(index.shape[1]):
        column = index[:, j]
        gathered = rows.index_select(0, column.clamp(max=max(num_rows - 1, 0))).float()
        if weights is not None:
            gathered = gathered * weights[:, j, None].float()
        total += torch.where((column < num_rows)[:, None], gathered, 0.0)
    return total.to(dtype)


def triton_gather_sum(
    rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """`gather_sum` as the MoE permutation's combine kernel with "none" entries masked (CUDA, or CPU under
    `TRITON_INTERPRET=1`)."""
    from d9d.kernels.moe_permute.triton_kernels import combine

    flat_weights = None if weights is None else weights.contiguous().reshape(-1)
    return combine(rows.contiguous(), index.reshape(-1), flat_weights, index.shape[1], masked=True, dtype=dtype)


def triton_row_dots(a: torch.Tensor, a_index: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`row_dots` as the MoE permutation's row-dot kernel, one row of `b` per output (`top_k` 1)."""
    from d9d.kernels.moe_permute.triton_kernels import dots

    return dots(b.contiguous(), a.contiguous(), a_index.contiguous(), 1)


def row_dots(a: torch.Tensor, a_index: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`(N,)` float32: `out[p] = <a[a_index[p]], b[p]>` (one Triton kernel on a GPU)."""
    if b.is_cuda and triton_importable():
        return triton_row_dots(a, a_index, b)
    return (a.index_select(0, a_index).float() * b.float()).sum(dim=-1)


class _SumFromSlots(torch.autograd.Function):
    """`(T, H)` in `dtype`: per token, the float32 sum of the rows that came back to its slots. Backward: slot `s`
    gets the gradient of token `slot_token[s]` (zero for an empty slot)."""

    @staticmethod
    def forward(
        ctx: Any, returned: torch.Tensor, token_slots: torch.Tensor, slot_token: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.save_for_backward(slot_token)
        ctx.dtype = returned.dtype
        return gather_sum(returned, token_slots, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (slot_token,) = ctx.saved_tensors
        padded = torch.cat([grad, grad.new_zeros(1, grad.shape[-1])])
        return padded.index_select(0, slot_token).to(ctx.dtype), None, None, None


class _WeightsToSlots(torch.autograd.Function):
    """`(ep * C, k)` float32: slot `s`'s combine weights for the experts of its destination, zero elsewhere
    (`slot_mask`). Backward: `(t, j)` reads the gradient of the one slot its expert's rank got (`copy_slot` `(T, k)`,
    `ep * C`: not sent)."""

    @staticmethod
    def forward(
        ctx: Any, weights: torch.Tensor, slot_token: torch.Tensor, slot_mask: torch.Tensor, copy_slot: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(copy_slot)
        ctx.dtype = weights.dtype
        padded = torch.cat([weights.float(), weights.new_zeros(1, weights.shape[-1], dtype=torch.float32)])
        return torch.where(slot_mask, padded.index_select(0, slot_token), 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (copy_slot,) = ctx.saved_tensors
        num_slots, top_k = grad.shape
        flat = (copy_slot.clamp(max=max(num_slots - 1, 0)) * top_k + torch.arange(top_k, device=grad.device)).reshape(
            -1
        )
        values = grad.reshape(-1).index_select(0, flat).view_as(copy_slot)
        return torch.where(copy_slot < num_slots, values, 0.0).to(ctx.dtype), None, None, None


class _SlotsToExpertRows(torch.autograd.Function):
    """Expert input `(M, H)`: row `p` is the received token of copy `kept_copy[p]` (slot `kept_copy[p] // k`).
    Backward: slot `s` sums the gradients of its kept copies in slot order (`copy_row` `(ep * C, k)`, `M`: none)."""

    @staticmethod
    def forward(
        ctx: Any, received: torch.Tensor, kept_copy: torch.Tensor, copy_row: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(copy_row)
        return received.index_select(0, kept_copy.div(top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (copy_row,) = ctx.saved_tensors
        return gather_sum(grad, copy_row), None, None, None


class _WeightedSumPerSlot(torch.autograd.Function):
    """Per received slot `(ep * C, H)`: the sum over its kept copies `j` of `weights[s, j] * expert_out[copy_row[s,
    j]]` (`rows`: the dispatch's `_ExpertRows`), accumulated in float32, returned in the experts' dtype. Backward:
    each kept copy's row gets its weight times its slot's gradient; each weight the dot product of its copy's row with
    that gradient."""

    @staticmethod
    def forward(ctx: Any, expert_out: torch.Tensor, weights: torch.Tensor, rows: _ExpertRows) -> torch.Tensor:
        ctx.save_for_backward(expert_out, weights, rows.kept_copy, rows.num_kept)
        return gather_sum(expert_out, rows.copy_row, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        expert_out, weights, kept_copy, num_kept = ctx.saved_tensors
        top_k = weights.shape[1]
        rows = torch.arange(expert_out.shape[0], device=grad.device)
        kept = rows < num_kept  # padding rows (past the groups) belong to no copy: zero, never read
        slot = kept_copy.div(top_k, rounding_mode="floor")
        row_weight = torch.where(kept, weights.reshape(-1).index_select(0, kept_copy), 0.0)
        grad_out = gather_sum(grad, slot[:, None], row_weight[:, None], dtype=expert_out.dtype)
        dots = torch.where(kept, row_dots(grad, slot, expert_out), 0.0)
        # Each kept copy owns one weight: a scatter to distinct places (padding rows write zeros past the end).
        grad_weights = torch.zeros(weights.numel() + 1, dtype=torch.float32, device=grad.device)
        grad_weights.scatter_(0, torch.where(kept, kept_copy, weights.numel()), dots)
        return grad_out, grad_weights[:-1].view_as(weights), None


@dataclass(frozen=True)
class _TokenPlan:
    token_slots: torch.Tensor
    slot_token: torch.Tensor
    slot_local: torch.Tensor  # (ep * C, k): local expert id at the slot's destination, -1 where none
    dropped: torch.Tensor


def _plan_token_sends(
    expert_indices: torch.Tensor, num_ranks: int, num_local: int, capacity: int
) -> tuple[_TokenPlan, torch.Tensor]:
    """Which token goes into which send slot, and the local expert ids each slot carries; also `copy_slot` `(T, k)`
    (the slot each copy's token went to for its expert's rank, `ep * C` when not sent)."""
    num_tokens, top_k = expert_indices.shape
    device = expert_indices.device
    indices = expert_indices.long()
    routed = indices >= 0
    dest = torch.where(routed, indices.div(num_local, rounding_mode="floor"), num_ranks)  # (T, k)
    needs = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.int64, device=device).scatter_(1, dest, 1)
    needs = needs[:, :num_ranks].t().contiguous()  # (ep, T): scans along contiguous memory
    position = needs.cumsum(dim=1) - 1
    sent = (needs > 0) & (position < capacity)
    num_slots = num_ranks * capacity
    ranks = torch.arange(num_ranks, device=device)[:, None]
    slot_of = torch.where(sent, ranks * capacity + position, num_slots)  # (ep, T)
    token_slots = slot_of.t().contiguous()  # (T, ep)
    tokens = torch.arange(num_tokens, device=device).expand(num_ranks, num_tokens)
    # Every sent (token, destination) owns a distinct slot; the unsent ones all write the extra entry, dropped after.
    slot_token = torch.full((num_slots + 1,), num_tokens, dtype=torch.int64, device=device)
    slot_token = slot_token.scatter_(0, slot_of.reshape(-1), tokens.reshape(-1))[:num_slots]
    token_slots_ext = torch.cat([token_slots, token_slots.new_full((num_tokens, 1), num_slots)], dim=1)
    copy_slot = token_slots_ext.gather(1, dest)  # (T, k)
    dropped = (routed & (copy_slot == num_slots)).sum()
    indices_ext = torch.cat([indices, indices.new_full((1, top_k), -1)])
    slot_indices = indices_ext.index_select(0, slot_token)  # (ep * C, k)
    slot_dest = torch.arange(num_slots, device=device).div(capacity, rounding_mode="floor")[:, None]
    on_dest = (slot_indices >= 0) & (slot_indices.div(num_local, rounding_mode="floor") == slot_dest)
    slot_local = torch.where(on_dest, slot_indices - slot_dest * num_local, -1)
    plan = _TokenPlan(token_slots=token_slots, slot_token=slot_token, slot_local=slot_local, dropped=dropped)
    return plan, copy_slot


def _expert_rows(received_local: torch.Tensor, num_local: int, num_rows: int) -> tuple[torch.Tensor, ...]:
    """From the received slots' local expert ids `(ep * C, k)`: the copy of each of the `M` expert rows (sorted by
    local expert, stable), each received copy's row (`M`: none or dropped), the group sizes, the kept and the dropped
    copies. All on the device."""
    top_k = received_local.shape[1]
    keys = torch.where(received_local >= 0, received_local, num_local).reshape(-1)
    order = torch.argsort(keys, stable=True)
    counts = count_per_expert(keys, num_local + 1)[:num_local]
    starts = counts.cumsum(0) - counts
    group_sizes = (num_rows - starts).clamp(min=0).minimum(counts)
    num_kept = group_sizes.sum()
    position = inverse_permutation(order)
    kept = (keys < num_local) & (position < num_kept)
    copy_row = torch.where(kept, position, num_rows).view(-1, top_k)
    return order[:num_rows], copy_row, group_sizes, num_kept, counts.sum() - num_kept


class AllToAllTokenCapacityDispatcher:
    """`TokenDispatcher` over `group` that sends each token once per destination rank, with static capacities (module
    docstring): `C` token rows per rank pair and `M` expert rows per rank; no host sync."""

    name = "all_to_all_tokens"
    traceable = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        token_capacity_factor: float = DEFAULT_TOKEN_CAPACITY_FACTOR,
        copy_capacity_factor: float = DEFAULT_COPY_CAPACITY_FACTOR,
    ) -> None:
        check_token_capacity_factors(token_capacity_factor, copy_capacity_factor)
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = split_experts(num_experts, self.num_ranks)
        self.token_capacity_factor = token_capacity_factor
        self.copy_capacity_factor = copy_capacity_factor
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        self.dropped_copies = torch.zeros((), dtype=torch.int64, device=device)
        self.rows_received = torch.zeros((), dtype=torch.int64, device=device)

    def dispatch(self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor) -> DispatchedTokens:
        check_routing(x, expert_indices, expert_weights)
        num_tokens, top_k = expert_indices.shape
        ep, num_local = self.num_ranks, self.num_local_experts
        capacity = token_pair_capacity(num_tokens, self.token_capacity_factor)
        num_rows = min(expert_row_capacity(num_tokens, top_k, ep, self.copy_capacity_factor), ep * capacity * top_k)
        plan, copy_slot = _plan_token_sends(expert_indices, ep, num_local, capacity)
        send = _TokensToSlots.apply(x, plan.slot_token, plan.token_slots)  # type: ignore[no-untyped-call]
        weights = _WeightsToSlots.apply(expert_weights, plan.slot_token, plan.slot_local >= 0, copy_slot)  # type: ignore[no-untyped-call]
        # The local expert ids travel with this rank's token count: `C` and `M` derive from `T`.
        meta = torch.cat([plan.slot_local.view(ep, capacity * top_k), plan.slot_local.new_full((ep, 1), num_tokens)], 1)
        exchanged = _wait(funcol.all_to_all_single(meta.reshape(-1), None, None, self.group)).view(ep, -1)
        torch._assert_async((exchanged[:, -1] == num_tokens).all(), token_count_mismatch_message(num_tokens))
        received_local = exchanged[:, :-1].reshape(ep * capacity, top_k)
        received = _exchange(send, self.group)
        received_weights = _exchange(weights, self.group)
        kept_copy, copy_row, group_sizes, num_kept, dropped_here = _expert_rows(received_local, num_local, num_rows)
        rows = _SlotsToExpertRows.apply(received, kept_copy, copy_row, top_k)  # type: ignore[no-untyped-call]
        self._accumulate(plan.dropped + dropped_here, num_kept)
        handle = _TokenHandle(
            token_slots=plan.token_slots,
            slot_token=plan.slot_token,
            received_weights=received_weights,
            rows=_ExpertRows(copy_row=copy_row, kept_copy=kept_copy, num_kept=num_kept),
            weights_dtype=expert_weights.dtype,
        )
        return DispatchedTokens(rows=rows, group_sizes=group_sizes, handle=handle)

    def combine(self, rows: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        handle = dispatched.handle
        assert isinstance(handle, _TokenHandle), "combine() needs the DispatchedTokens of this dispatcher"
        partial = _WeightedSumPerSlot.apply(rows, handle.received_weights, handle.rows)  # type: ignore[no-untyped-call]
        returned = _exchange(partial, self.group)
        # The dtype the other dispatchers' weighted sums give (expert rows times combine weights).
        dtype = torch.promote_types(rows.dtype, handle.weights_dtype)
        out: torch.Tensor = _SumFromSlots.apply(returned, handle.token_slots, handle.slot_token, dtype)  # type: ignore[no-untyped-call]
        return out

    def _accumulate(self, dropped: torch.Tensor, received: torch.Tensor) -> None:
        # Reassigned, not updated in place: compiled callers trace an attribute store, not a mutation.
        self.dropped_copies = self.dropped_copies + dropped.detach()
        self.rows_received = self.rows_received + received.detach()
