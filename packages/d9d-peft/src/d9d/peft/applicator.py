"""Freeze a model, inject a method, unfreeze what it trains; merge; the adapter part of a model's state."""

from __future__ import annotations

from torch import nn

from d9d.peft.base import PeftInjectionResult, PeftMethod
from d9d.peft.lora import LoRAGroupedLinear, LoRALinear
from d9d.peft.lora.merge import reshard_fsdp_modules


def inject_peft_and_freeze(method: PeftMethod, module: nn.Module) -> PeftInjectionResult:
    """Freeze every parameter, inject `method`, then unfreeze exactly `parameters_to_train`.

    Call it on the meta-device model before the parallel plan, so FSDP shards the adapters like any parameter.
    """
    for param in module.parameters():
        param.requires_grad = False
    result = method.inject(module)
    params = dict(module.named_parameters())
    unknown = sorted(result.parameters_to_train - params.keys())
    if unknown:
        raise ValueError(f"{type(method).__name__} reports parameters the model lacks: {unknown[:5]}")
    if not result.parameters_to_train:
        raise ValueError(f"{type(method).__name__} selected no parameter to train")
    for name in result.parameters_to_train:
        params[name].requires_grad = True
    return result


def merge_peft(method: PeftMethod, module: nn.Module) -> None:
    """Fold the adapters into the base weights in place (every rank calls it: sharded adapters are gathered).

    FSDP modules are resharded first, so the merge writes into the sharded weights that `state_dict` saves."""
    reshard_fsdp_modules(module)
    method.merge(module)


def adapter_state_names(module: nn.Module) -> set[str]:
    """The state names LoRA added to `module` (absent from any checkpoint of the base model)."""
    names: set[str] = set()
    for name, sub in module.named_modules():
        if isinstance(sub, LoRALinear | LoRAGroupedLinear):
            prefix = f"{name}." if name else ""
            names |= {f"{prefix}lora_A", f"{prefix}lora_B"}
    return names


def trainable_parameter_names(module: nn.Module) -> list[str]:
    return [name for name, param in module.named_parameters() if param.requires_grad]
