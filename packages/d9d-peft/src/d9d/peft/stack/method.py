"""`PeftStack`: inject each method in order; train the union of what they train."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from d9d.peft.base import PeftInjectionResult, PeftMethod


class PeftStack(PeftMethod):
    def __init__(self, methods: Sequence[PeftMethod]) -> None:
        if not methods:
            raise ValueError("stack: methods is empty; give at least one PEFT method")
        self.methods = list(methods)

    def inject(self, module: nn.Module) -> PeftInjectionResult:
        train: set[str] = set()
        adapters: set[str] = set()
        for method in self.methods:
            result = method.inject(module)
            train |= result.parameters_to_train
            adapters |= result.adapter_names
        return PeftInjectionResult.of(module, train=train, adapters=adapters)

    def merge(self, module: nn.Module) -> None:
        for method in reversed(self.methods):
            method.merge(module)
