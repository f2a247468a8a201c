"""Experts stored stacked `(E, ...)` and run as grouped matmuls over tokens sorted by expert."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import d9d.models.blocks.pipeline_split  # noqa: F401 - registers the pipeline's weight-gradient sink
from d9d.kernels.grouped_mm import GroupedMm
from d9d.kernels.grouped_mm.deferrable import deferrable_grouped_mm
from d9d.kernels.swiglu import EagerSwiGlu, SwiGluKernel
from d9d.models.blocks.late_init import init_normal_


class LocalShardGroupedMm:
    """Runs `inner` on the local shard of a DTensor weight: under expert parallelism a rank's stacked weights
    (`(E/ep, ...)`, `Shard(0)` over `ep`) are exactly the experts its dispatched rows are grouped by."""

    def __init__(self, inner: GroupedMm) -> None:
        self.inner = inner
        self.name = inner.name

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        return self.inner(x, weight.to_local() if isinstance(weight, DTensor) else weight, group_sizes)


class GroupedLinear(nn.Module):
    """One `in -> out` linear map per expert: `weight` is `(E, out, in)`, the `nn.Linear` layout stacked."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, backend: GroupedMm) -> None:
        super().__init__()
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        # The backend itself, except in a pipeline forward the weight-gradient store splits (design note 0024).
        return deferrable_grouped_mm(self.backend, x, self.weight, group_sizes)

    def extra_repr(self) -> str:
        experts, out_features, in_features = self.weight.shape
        return f"experts={experts}, in_features={in_features}, out_features={out_features}"


class GroupedSwiGLU(nn.Module):
    """A SwiGLU per expert over rows sorted by expert (`group_sizes` rows each)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, backend: GroupedMm, init_std: float = 0.02
    ) -> None:
        super().__init__()
        self.init_std = init_std
        self.gate_proj = GroupedLinear(num_experts, hidden_size, intermediate_size, backend=backend)
        self.up_proj = GroupedLinear(num_experts, hidden_size, intermediate_size, backend=backend)
        self.down_proj = GroupedLinear(num_experts, intermediate_size, hidden_size, backend=backend)
        self.swiglu_kernel: SwiGluKernel = EagerSwiGlu()

    def set_backend(self, backend: GroupedMm) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            linear.backend = backend

    def use_local_shards(self) -> None:
        """Make each projection (or the adapter wrapping it) run its backend on local expert shards."""
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            if not isinstance(linear.backend, LocalShardGroupedMm):
                linear.backend = LocalShardGroupedMm(linear.backend)

    def reset_parameters(self) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            init_normal_(linear.weight, self.init_std)

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        hidden = self.swiglu_kernel(self.gate_proj(x, group_sizes), self.up_proj(x, group_sizes))
        out: torch.Tensor = self.down_proj(hidden, group_sizes)
        return out
