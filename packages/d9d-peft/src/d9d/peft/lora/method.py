"""`LoRA`: the PEFT method that wraps matched linear and grouped-expert layers in LoRA modules."""

from __future__ import annotations

from torch import nn

from d9d.models.blocks.moe import GroupedLinear
from d9d.peft.base import PeftInjectionResult, PeftMethod
from d9d.peft.config import LoRAConfig
from d9d.peft.lora.grouped import LoRAGroupedLinear
from d9d.peft.lora.linear import LoRALinear
from d9d.peft.lora.merge import fsdp_managed_modules, reshard_fsdp_modules
from d9d.peft.matching import matching_modules, replace_module

LoRAModule = LoRALinear | LoRAGroupedLinear


class LoRA(PeftMethod):
    def __init__(self, config: LoRAConfig) -> None:
        self.config = config

    def inject(self, module: nn.Module) -> PeftInjectionResult:
        matched = matching_modules(module, self.config.module_name_pattern, method="lora")
        adapters: set[str] = set()
        for name, target in matched:
            replacement: LoRAModule
            if isinstance(target, LoRALinear | LoRAGroupedLinear):
                raise ValueError(f"lora: module {name!r} already has a LoRA adapter (two LoRA methods match it)")
            if isinstance(target, nn.Linear):
                replacement = LoRALinear(target, self.config.params)
            elif isinstance(target, GroupedLinear):
                replacement = LoRAGroupedLinear(target, self.config.params)
            else:
                raise ValueError(
                    f"lora: module_name_pattern={self.config.module_name_pattern.pattern!r} matches {name!r}, a "
                    f"{type(target).__name__}; LoRA applies to nn.Linear and GroupedLinear (MoE experts) only"
                )
            replace_module(module, name, replacement)
            adapters |= {f"{name}.lora_A", f"{name}.lora_B"}
        return PeftInjectionResult.of(module, train=set(adapters), adapters=adapters)

    def merge(self, module: nn.Module) -> None:
        reshard_fsdp_modules(module)  # a forward may have left FSDP's unsharded copies in place of the weights
        managed = fsdp_managed_modules(module)
        for name, sub in module.named_modules():
            if isinstance(sub, LoRALinear | LoRAGroupedLinear) and self.config.module_name_pattern.fullmatch(name):
                sub.merge_(fsdp_managed=id(sub) in managed)
