"""The metric interface: update locally, synchronise over a process group (asynchronously), compute, reset.

A metric's state is a few named float64 tensors, each with the reduction that merges two ranks' states (sum, min
or max; there is no "mean" on purpose: a mean is a sum and a count). Because every state merges exactly, the synced
result equals the single-process computation over the union of the ranks' data. float64 keeps counts exact up to
2**53.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

import torch

TResult = TypeVar("TResult")


class Reduce(Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"


@dataclass(frozen=True)
class _StateSpec:
    default: torch.Tensor
    reduce: Reduce


class Metric(ABC, Generic[TResult]):
    """Subclasses declare states with `add_state`, fold data in with `update` and read states in `_compute`."""

    def __init__(self) -> None:
        self._specs: dict[str, _StateSpec] = {}
        self._states: dict[str, torch.Tensor] = {}

    def add_state(self, name: str, default: torch.Tensor | float, reduce: Reduce) -> None:
        tensor = torch.as_tensor(default, dtype=torch.float64).clone()
        self._specs[name] = _StateSpec(tensor, reduce)
        self._states[name] = tensor.clone()

    @property
    def states(self) -> Mapping[str, torch.Tensor]:
        return self._states

    def specs(self) -> Mapping[str, Reduce]:
        return {name: spec.reduce for name, spec in self._specs.items()}

    @abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Fold local data into the local state (no communication)."""

    @abstractmethod
    def _compute(self, states: Mapping[str, torch.Tensor]) -> TResult:
        """The result from a (local or synced) state."""

    def compute(self) -> TResult:
        """The result of this rank's data only; use `sync` (or a `MetricSync`) for the global one."""
        return self._compute(self._states)

    def compute_from(self, states: Mapping[str, torch.Tensor]) -> TResult:
        return self._compute(states)

    def reset(self) -> None:
        self._states = {name: spec.default.clone() for name, spec in self._specs.items()}

    def to(self, device: torch.device | str) -> Metric[TResult]:
        """Move the state (e.g. to CUDA so NCCL can reduce it; gloo reduces CPU tensors)."""
        self._specs = {name: _StateSpec(spec.default.to(device), spec.reduce) for name, spec in self._specs.items()}
        self._states = {name: state.to(device) for name, state in self._states.items()}
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        missing, unexpected = set(self._specs) - set(state), set(state) - set(self._specs)
        if missing or unexpected:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: missing states {sorted(missing)}, unexpected "
                f"{sorted(unexpected)}; expected exactly {sorted(self._specs)}"
            )
        for name, value in state.items():
            expected = self._specs[name].default.shape
            if value.shape != expected:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: state {name!r} has shape {tuple(value.shape)}, "
                    f"expected {tuple(expected)}"
                )
            self._states[name] = value.to(self._states[name].device, torch.float64).clone()

    def _fold(self, name: str, value: torch.Tensor | float) -> None:
        """Merge `value` into state `name` with the state's own reduction."""
        current = self._states[name]
        tensor = torch.as_tensor(value, dtype=torch.float64, device=current.device)
        match self._specs[name].reduce:
            case Reduce.SUM:
                self._states[name] = current + tensor
            case Reduce.MIN:
                self._states[name] = torch.minimum(current, tensor)
            case Reduce.MAX:
                self._states[name] = torch.maximum(current, tensor)
