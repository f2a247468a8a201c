"""`FullTune`: no new parameters; the matched modules' own parameters train."""

from __future__ import annotations

from torch import nn

from d9d.peft.base import PeftInjectionResult, PeftMethod
from d9d.peft.config import FullTuneConfig
from d9d.peft.matching import matching_modules


class FullTune(PeftMethod):
    def __init__(self, config: FullTuneConfig) -> None:
        self.config = config

    def inject(self, module: nn.Module) -> PeftInjectionResult:
        matched = matching_modules(module, self.config.module_name_pattern, method="full_tune")
        train = {f"{name}.{param_name}" for name, sub in matched for param_name, _ in sub.named_parameters()}
        return PeftInjectionResult.of(module, train=train, adapters=set())

    def merge(self, module: nn.Module) -> None:
        """Nothing to fold: the tuned weights are the base weights."""
