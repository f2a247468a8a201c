"""Expert parallelism over DeepEP (`deep_ep.Buffer`, optional extra `deep-ep`), imported on first use.

Normal (high-throughput) mode trains: `get_dispatch_layout` + `dispatch` send each token once per destination rank
(not once per expert), with its top-k indices (local, `-1` elsewhere) and weights; this rank's experts run on the
received copies sorted by local expert, their outputs are weighted and summed per received token, and `combine` sums
those back on the source rank. Backward of dispatch is a combine of the gradients (and of the weights' gradients)
with the same handle, backward of combine a cached dispatch: DeepEP's own recipe. Low-latency mode (inference only,
needs NVSHMEM with IBGDA) dispatches into per-expert buffers and combines with the weights inside the kernel.
The calls follow DeepEP's v1 `Buffer` API (1.0.0 on PyPI through 1.2.1); see bench/build_deepep.sh to build it.
`dispatch` and `combine` never run under Dynamo (`eager_only`): see `TokenDispatcher`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from d9d.kernels.eager_only import eager_only
from d9d.kernels.errors import BackendUnavailable
from d9d.kernels.expert_dispatch.api import DispatchedTokens, check_routing, mark_row_count_dynamic, split_experts
from d9d.kernels.expert_dispatch.sorting import ExpertOrder, gather_sorted_rows, sort_by_expert, weighted_unsort

DeepEpMode = Literal["normal", "low_latency"]


def import_deep_ep() -> Any:
    try:
        return importlib.import_module("deep_ep")
    except ImportError as error:
        raise BackendUnavailable(
            f"the expert-dispatch backend 'deep_ep' needs the deep_ep package (DeepEP), which is not importable "
            f"({error}); build it on the GPU machine with bench/build_deepep.sh (see docs/testing.md), or choose "
            "kind='all_to_all'"
        ) from error


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 - autograd.Function.apply passes its inputs positionally
        ctx: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buffer: Any, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, list[int]]:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_weights, recv_per_expert, handle, _ = buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_weights, handle, list(recv_per_expert)

    @staticmethod
    def backward(
        ctx: Any, grad_x: torch.Tensor, _idx: Any, grad_weights: torch.Tensor | None, *_: Any
    ) -> tuple[torch.Tensor, None, torch.Tensor | None, None, None]:
        weights = None if grad_weights is None else grad_weights.float().contiguous()
        combined, combined_weights, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=weights)
        return combined, None, combined_weights, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, buffer: Any, handle: Any) -> torch.Tensor:
        ctx.buffer, ctx.handle = buffer, handle
        combined, _, _ = buffer.combine(x.contiguous(), handle)
        assert isinstance(combined, torch.Tensor)
        return combined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_x, None, None


@dataclass(frozen=True)
class _NormalHandle:
    deep_ep_handle: Any
    sort: ExpertOrder
    recv_weights: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class _LowLatencyHandle:
    deep_ep_handle: Any
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    counts: list[int]
    buffer_shape: tuple[int, ...]


class DeepEpDispatcher:
    """`TokenDispatcher` over DeepEP on the NCCL `group` (one host, NVLink between its GPUs, for normal mode)."""

    name = "deep_ep"
    traceable = False

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        *,
        mode: DeepEpMode = "normal",
        num_nvl_bytes: int = 1_000_000_000,
        num_sms: int = 24,
        max_dispatch_tokens_per_rank: int = 128,
    ) -> None:
        self._deep_ep = import_deep_ep()
        self.group = group
        self.num_experts = num_experts
        self.num_local_experts = split_experts(num_experts, dist.get_world_size(group))
        self.mode: DeepEpMode = mode
        self.num_nvl_bytes, self.max_dispatch_tokens_per_rank = num_nvl_bytes, max_dispatch_tokens_per_rank
        self._deep_ep.Buffer.set_num_sms(num_sms)
        self._buffer: Any = None

    def _topk_idx(self, expert_indices: torch.Tensor) -> torch.Tensor:
        """DeepEP >= 1.2 names its index dtype `deep_ep.topk_idx_t` (int64 by default); 1.0.0 wants int64."""
        dtype = getattr(self._deep_ep, "topk_idx_t", torch.int64)
        return expert_indices.to(dtype if isinstance(dtype, torch.dtype) else torch.int64)

    def _buffer_for(self, hidden: int) -> Any:
        """The communication buffer, allocated on first use (low-latency sizing needs the hidden size)."""
        if self._buffer is None:
            buffer_cls = self._deep_ep.Buffer
            if self.mode == "normal":
                self._buffer = buffer_cls(self.group, self.num_nvl_bytes, 0)
            else:
                ranks = dist.get_world_size(self.group)
                rdma_bytes = buffer_cls.get_low_latency_rdma_size_hint(
                    self.max_dispatch_tokens_per_rank, hidden, ranks, self.num_experts
                )
                self._buffer = buffer_cls(
                    self.group, 0, rdma_bytes, low_latency_mode=True, num_qps_per_rank=self.num_local_experts
                )
        return self._buffer

    @eager_only
    def dispatch(self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor) -> DispatchedTokens:
        check_routing(x, expert_indices, expert_weights)
        if x.dtype != torch.bfloat16:
            raise ValueError(
                f"the deep_ep expert dispatch sends bfloat16 tokens, got {x.dtype}; train with bfloat16 "
                "mixed precision or choose kind='all_to_all'"
            )
        if self.mode == "low_latency":
            return self._dispatch_low_latency(x, expert_indices, expert_weights)
        buffer = self._buffer_for(x.shape[-1])
        recv_x, recv_idx, recv_weights, handle, per_expert = _Dispatch.apply(  # type: ignore[no-untyped-call]
            x, self._topk_idx(expert_indices), expert_weights.float(), buffer, self.num_experts
        )
        sort = sort_by_expert(recv_idx, self.num_local_experts, may_drop=True)
        rows = gather_sorted_rows(recv_x, sort, recv_idx.shape[1], sum(per_expert))
        group_sizes = torch.tensor(per_expert, dtype=torch.int64, device=x.device)
        return DispatchedTokens(
            rows=mark_row_count_dynamic(rows),
            group_sizes=group_sizes,
            handle=_NormalHandle(deep_ep_handle=handle, sort=sort, recv_weights=recv_weights, dtype=x.dtype),
        )

    @eager_only
    def combine(self, rows: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        handle = dispatched.handle
        if isinstance(handle, _LowLatencyHandle):
            return self._combine_low_latency(rows, handle)
        assert isinstance(handle, _NormalHandle), "combine() needs the DispatchedTokens of this dispatcher"
        per_received = weighted_unsort(rows, handle.sort, handle.recv_weights).to(handle.dtype)
        combined = _Combine.apply(per_received, self._buffer, handle.deep_ep_handle)  # type: ignore[no-untyped-call]
        assert isinstance(combined, torch.Tensor)
        return combined

    # Low-latency mode (inference) ------------------------------------------------------------------------------

    def _dispatch_low_latency(
        self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor
    ) -> DispatchedTokens:
        if torch.is_grad_enabled():
            raise RuntimeError("deep_ep low-latency mode is for inference: run it under torch.no_grad()")
        if x.shape[0] > self.max_dispatch_tokens_per_rank:
            raise ValueError(
                f"{x.shape[0]} tokens exceed max_dispatch_tokens_per_rank={self.max_dispatch_tokens_per_rank} "
                "of the deep_ep low-latency config; raise it"
            )
        buffer = self._buffer_for(x.shape[-1])
        method = buffer.low_latency_dispatch
        extra = {"use_fp8": False} if "use_fp8" in inspect.signature(method).parameters else {}
        topk_idx = self._topk_idx(expert_indices)
        recv, counts_tensor, handle, _, _ = method(
            x, topk_idx, self.max_dispatch_tokens_per_rank, self.num_experts, **extra
        )
        per_expert = _dequantize(recv)  # (local experts, slots, hidden); DeepEP 1.0.0 always sends FP8
        counts = [int(n) for n in counts_tensor.tolist()]
        rows = torch.cat([per_expert[e, :n] for e, n in enumerate(counts)]).to(x.dtype)
        return DispatchedTokens(
            rows=mark_row_count_dynamic(rows),
            group_sizes=torch.tensor(counts, dtype=torch.int64, device=x.device),
            handle=_LowLatencyHandle(
                deep_ep_handle=handle,
                topk_idx=topk_idx,
                topk_weights=expert_weights.float(),
                counts=counts,
                buffer_shape=tuple(per_expert.shape),
            ),
        )

    def _combine_low_latency(self, rows: torch.Tensor, handle: _LowLatencyHandle) -> torch.Tensor:
        packed = rows.new_zeros(handle.buffer_shape)
        for expert, part in enumerate(torch.split(rows, handle.counts)):
            packed[expert, : part.shape[0]] = part
        combined, _, _ = self._buffer.low_latency_combine(
            packed.to(torch.bfloat16), handle.topk_idx, handle.topk_weights, handle.deep_ep_handle
        )
        assert isinstance(combined, torch.Tensor)
        return combined


def _dequantize(received: Any) -> torch.Tensor:
    """DeepEP's FP8 payload `(values, per-128-channel scales)` as float32; a plain tensor passes through."""
    if isinstance(received, torch.Tensor):
        return received
    values, scales = received
    dequantized: torch.Tensor = values.float() * scales.float().repeat_interleave(128, dim=-1)[..., : values.shape[-1]]
    return dequantized
