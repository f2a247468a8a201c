"""LoRA on linear layers and on grouped MoE experts."""

from d9d.peft.lora.grouped import LoRAGroupedLinear
from d9d.peft.lora.linear import LoRALinear
from d9d.peft.lora.method import LoRA, LoRAModule

__all__ = ["LoRA", "LoRAGroupedLinear", "LoRALinear", "LoRAModule"]
