"""Language-model figures from summed losses: perplexity per token and bits per byte of text."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from d9d.metrics.metric import Metric, Reduce


def _nats(loss_sum: torch.Tensor | float) -> float:
    return float(torch.as_tensor(loss_sum).detach().to(torch.float64).sum())


class PerplexityMetric(Metric[float]):
    """exp(summed cross-entropy in nats / counted tokens). Update with a loss *sum*, never a per-batch mean, so
    batches of different sizes weigh by their tokens. NaN before any token; inf where exp overflows a float."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", 0.0, Reduce.SUM)
        self.add_state("tokens", 0.0, Reduce.SUM)

    def update(self, loss_sum: torch.Tensor | float, tokens: int | float) -> None:
        if tokens < 0:
            raise ValueError(f"PerplexityMetric.update: tokens must be >= 0, got {tokens}")
        self._fold("loss_sum", _nats(loss_sum))
        self._fold("tokens", float(tokens))

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        tokens = float(states["tokens"])
        if not tokens:
            return math.nan
        try:
            return math.exp(float(states["loss_sum"]) / tokens)
        except OverflowError:  # above ~709.78 nats/token (a diverged step): inf, not an exception in the logger
            return math.inf


class BitsPerByteMetric(Metric[float]):
    """Summed cross-entropy in nats / (ln 2 * bytes of text those tokens stand for): tokenizer-independent."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", 0.0, Reduce.SUM)
        self.add_state("bytes", 0.0, Reduce.SUM)

    def update(self, loss_sum: torch.Tensor | float, num_bytes: int | float) -> None:
        if num_bytes < 0:
            raise ValueError(f"BitsPerByteMetric.update: num_bytes must be >= 0, got {num_bytes}")
        self._fold("loss_sum", _nats(loss_sum))
        self._fold("bytes", float(num_bytes))

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        num_bytes = float(states["bytes"])
        return float(states["loss_sum"]) / (math.log(2) * num_bytes) if num_bytes else math.nan
