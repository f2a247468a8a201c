"""The PEFT method interface: inject into a (meta or materialised) model, report what trains, merge back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import nn

from d9d.states.mapper import Identity, ModelStateMapper


@dataclass(frozen=True, kw_only=True)
class PeftInjectionResult:
    """What an injection changed.

    Injected modules keep the base parameter names (`q_proj.weight` stays `q_proj.weight`), so a checkpoint of the
    original model loads unchanged: `load_state_mapper` is the identity over the base names, and the adapters
    (`adapter_names`) are the only names a base checkpoint lacks.
    """

    parameters_to_train: frozenset[str]
    adapter_names: frozenset[str]
    load_state_mapper: ModelStateMapper

    @classmethod
    def of(cls, module: nn.Module, *, train: set[str], adapters: set[str]) -> PeftInjectionResult:
        base_names = [name for name in module.state_dict() if name not in adapters]
        return cls(
            parameters_to_train=frozenset(train),
            adapter_names=frozenset(adapters),
            load_state_mapper=Identity(base_names),
        )


class PeftMethod(ABC):
    """A way to make a model fine-tunable; `inject` is called on the meta-device model before parallelisation."""

    @abstractmethod
    def inject(self, module: nn.Module) -> PeftInjectionResult:
        """Modify `module` in place; returns the parameters to train and how base checkpoints map onto it."""

    @abstractmethod
    def merge(self, module: nn.Module) -> None:
        """Fold what `inject` added into the base weights (the model then computes as the merged base model)."""
