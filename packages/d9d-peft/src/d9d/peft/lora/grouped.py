"""LoRA on grouped MoE experts: one adapter per expert, stacked `A` `(E, r, in)` and `B` `(E, out, r)`."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from d9d.models.blocks.moe import GroupedLinear
from d9d.peft.config import LoRAParameters
from d9d.peft.lora.init import adapter_parameter, init_lora_a_, init_lora_b_
from d9d.peft.lora.merge import add_full_, full


class LoRAGroupedLinear(GroupedLinear):
    """Rows sorted by expert run through their expert's base weight plus `scaling * x A_e^T B_e^T`, both adapter
    products as grouped matmuls on the same backend; the stacked `weight` keeps its name and object."""

    def __init__(self, base: GroupedLinear, params: LoRAParameters) -> None:
        nn.Module.__init__(self)  # reuse the base weight; GroupedLinear.__init__ would allocate a new one
        self.backend = base.backend
        self.weight = base.weight
        experts, out_features, in_features = base.weight.shape
        self.in_features = in_features
        self.params = params
        self.r, self.scaling, self.dropout = params.r, params.scaling, params.dropout
        self.lora_A = adapter_parameter(experts, params.r, in_features, like=base.weight)
        self.lora_B = adapter_parameter(experts, out_features, params.r, like=base.weight)
        self.merged = False
        if not base.weight.is_meta:
            self.reset_adapter_parameters()

    def reset_adapter_parameters(self) -> None:
        init_lora_a_(self.lora_A, self.in_features)
        init_lora_b_(self.lora_B)

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        out = self.backend(x, self.weight, group_sizes)
        if self.merged:
            return out
        dropped = functional.dropout(x, self.dropout, self.training) if self.dropout else x
        low_rank = self.backend(dropped, self.lora_A, group_sizes)
        return out + self.backend(low_rank, self.lora_B, group_sizes) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """`scaling * B_e A_e` per expert, `(E, out, in)` (a collective when the adapters are sharded)."""
        return torch.bmm(full(self.lora_B).float(), full(self.lora_A).float()) * self.scaling

    @torch.no_grad()
    def merge_(self, *, fsdp_managed: bool = False) -> None:
        if self.merged:
            return
        add_full_(self.weight, self.delta_weight(), fsdp_managed=fsdp_managed)
        self.merged = True

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}, merged={self.merged}"
