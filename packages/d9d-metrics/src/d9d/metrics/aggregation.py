"""Sum, mean, weighted mean, min and max of scalars or tensors (every element counts)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from d9d.metrics.metric import Metric, Reduce


def _as_tensor(value: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(value).detach().to(torch.float64)


class SumMetric(Metric[float]):
    def __init__(self) -> None:
        super().__init__()
        self.add_state("sum", 0.0, Reduce.SUM)

    def update(self, value: torch.Tensor | float) -> None:
        self._fold("sum", _as_tensor(value).sum())

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        return float(states["sum"])


class MeanMetric(Metric[float]):
    """The mean of every element seen; NaN before any update."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("sum", 0.0, Reduce.SUM)
        self.add_state("count", 0.0, Reduce.SUM)

    def update(self, value: torch.Tensor | float) -> None:
        tensor = _as_tensor(value)
        self._fold("sum", tensor.sum())
        self._fold("count", float(tensor.numel()))

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        count = float(states["count"])
        return float(states["sum"]) / count if count else math.nan


class WeightedMeanMetric(Metric[float]):
    """sum(value * weight) / sum(weight), e.g. a loss weighted by token counts; NaN while the weight is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("weighted_sum", 0.0, Reduce.SUM)
        self.add_state("weight", 0.0, Reduce.SUM)

    def update(self, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        values, weights = _as_tensor(value), _as_tensor(weight)
        values, weights = values + torch.zeros_like(weights), weights + torch.zeros_like(values)  # broadcast
        if bool((weights < 0).any()):
            raise ValueError(f"WeightedMeanMetric.update: weight must be >= 0, got a minimum of {float(weights.min())}")
        self._fold("weighted_sum", (values * weights).sum())
        self._fold("weight", weights.sum())

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        weight = float(states["weight"])
        return float(states["weighted_sum"]) / weight if weight else math.nan


class MinMetric(Metric[float]):
    """The smallest element seen (+inf before any update)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("min", math.inf, Reduce.MIN)

    def update(self, value: torch.Tensor | float) -> None:
        tensor = _as_tensor(value)
        if tensor.numel():
            self._fold("min", tensor.min())

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        return float(states["min"])


class MaxMetric(Metric[float]):
    """The largest element seen (-inf before any update)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("max", -math.inf, Reduce.MAX)

    def update(self, value: torch.Tensor | float) -> None:
        tensor = _as_tensor(value)
        if tensor.numel():
            self._fold("max", tensor.max())

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        return float(states["max"])
