"""LoRA on an `nn.Linear`: `y = x W^T + b + scaling * dropout(x) A^T B^T`, `A` `(r, in)`, `B` `(out, r)`."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from d9d.peft.config import LoRAParameters
from d9d.peft.lora.init import adapter_parameter, init_lora_a_, init_lora_b_
from d9d.peft.lora.merge import add_full_, full


class LoRALinear(nn.Linear):
    """Takes over the base layer's own `weight`/`bias` parameters (same objects, same names) and adds
    `lora_A`, `lora_B`. Being an `nn.Linear`, the block that owns it still initialises `weight` in its
    `reset_parameters`; the adapters are initialised by `reset_adapter_parameters` (`materialize_` calls it)."""

    def __init__(self, base: nn.Linear, params: LoRAParameters) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: the base layer's parameters are reused, not reallocated
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.params = params
        self.r, self.scaling, self.dropout = params.r, params.scaling, params.dropout
        self.lora_A = adapter_parameter(params.r, base.in_features, like=base.weight)
        self.lora_B = adapter_parameter(base.out_features, params.r, like=base.weight)
        self.merged = False
        if not base.weight.is_meta:
            self.reset_adapter_parameters()

    def reset_adapter_parameters(self) -> None:
        init_lora_a_(self.lora_A, self.in_features)
        init_lora_b_(self.lora_B)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.reset_adapter_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = functional.linear(x, self.weight, self.bias)
        if self.merged:
            return out
        dropped = functional.dropout(x, self.dropout, self.training) if self.dropout else x
        return out + functional.linear(functional.linear(dropped, self.lora_A), self.lora_B) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """`scaling * B A`, the whole `(out, in)` matrix (a collective when the adapters are sharded)."""
        return (full(self.lora_B).float() @ full(self.lora_A).float()) * self.scaling

    @torch.no_grad()
    def merge_(self, *, fsdp_managed: bool = False) -> None:
        """Fold the adapter into `weight`; the layer then computes `x W'^T + b` only. `fsdp_managed`: FSDP shards
        this layer, so `weight` must be in its sharded state (see `add_full_`)."""
        if self.merged:
            return
        add_full_(self.weight, self.delta_weight(), fsdp_managed=fsdp_managed)
        self.merged = True

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}, merged={self.merged}"
