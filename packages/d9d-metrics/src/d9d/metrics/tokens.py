"""Token counts and throughput. Ranks run concurrently, so global throughput is the summed tokens over the longest
rank's elapsed time (a max, not a sum, of the seconds)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from d9d.metrics.metric import Metric, Reduce


class TokenCountMetric(Metric[int]):
    def __init__(self) -> None:
        super().__init__()
        self.add_state("tokens", 0.0, Reduce.SUM)

    def update(self, tokens: int | torch.Tensor) -> None:
        count = float(torch.as_tensor(tokens).sum())
        if count < 0:
            raise ValueError(f"TokenCountMetric.update: tokens must be >= 0, got {count}")
        self._fold("tokens", count)

    def _compute(self, states: Mapping[str, torch.Tensor]) -> int:
        return int(states["tokens"])


class ThroughputMetric(Metric[float]):
    """Tokens per second over all ranks: sum of tokens / max of each rank's summed seconds. NaN before any time."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("tokens", 0.0, Reduce.SUM)
        self.add_state("local_seconds", 0.0, Reduce.SUM)  # this rank's elapsed time (summed only locally)
        self.add_state("seconds", 0.0, Reduce.MAX)  # the slowest rank's elapsed time after a sync

    def update(self, tokens: int | float, seconds: float) -> None:
        if tokens < 0 or seconds < 0:
            raise ValueError(f"ThroughputMetric.update: tokens={tokens} and seconds={seconds} must both be >= 0")
        self._fold("tokens", float(tokens))
        self._fold("local_seconds", float(seconds))
        self._states["seconds"] = self._states["local_seconds"].clone()

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        seconds = float(states["seconds"])
        return float(states["tokens"]) / seconds if seconds > 0 else math.nan
