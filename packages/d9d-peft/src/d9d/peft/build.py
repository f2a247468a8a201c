"""`build_peft_method`: the one place a PEFT config becomes a method."""

from __future__ import annotations

from typing import assert_never

from d9d.peft.base import PeftMethod
from d9d.peft.config import AnyPeftConfig, FullTuneConfig, LoRAConfig, PeftStackConfig
from d9d.peft.full_tune import FullTune
from d9d.peft.lora import LoRA
from d9d.peft.stack import PeftStack


def build_peft_method(config: AnyPeftConfig) -> PeftMethod:
    match config:
        case LoRAConfig():
            return LoRA(config)
        case FullTuneConfig():
            return FullTune(config)
        case PeftStackConfig():
            return PeftStack([build_peft_method(method) for method in config.methods])
        case _:
            assert_never(config)
