"""Parameter-efficient fine-tuning for d9d: LoRA (linear and grouped experts), full tune, stacking, merge, export.

Inject with `inject_peft_and_freeze(build_peft_method(config), model)` on the meta-device model, before the
parallel plan (so FSDP shards the adapters too), then parallelise and `materialize_` as usual. See docs/peft.md.
"""

from d9d.peft.applicator import adapter_state_names, inject_peft_and_freeze, merge_peft, trainable_parameter_names
from d9d.peft.base import PeftInjectionResult, PeftMethod
from d9d.peft.build import build_peft_method
from d9d.peft.config import AnyPeftConfig, FullTuneConfig, LoRAConfig, LoRAParameters, PeftStackConfig
from d9d.peft.full_tune import FullTune
from d9d.peft.lora import LoRA, LoRAGroupedLinear, LoRALinear
from d9d.peft.stack import PeftStack

__all__ = [
    "AnyPeftConfig",
    "FullTune",
    "FullTuneConfig",
    "LoRA",
    "LoRAConfig",
    "LoRAGroupedLinear",
    "LoRALinear",
    "LoRAParameters",
    "PeftInjectionResult",
    "PeftMethod",
    "PeftStack",
    "PeftStackConfig",
    "adapter_state_names",
    "build_peft_method",
    "inject_peft_and_freeze",
    "merge_peft",
    "trainable_parameter_names",
]
