"""What one rank's part of a pipeline step returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepOutcome:
    """This rank's part of a step: summed (unscaled) losses and metric sums of the micro-batches whose last stage
    it holds (zero and empty elsewhere)."""

    loss_sum: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)
