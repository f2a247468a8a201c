"""Step schedules: how one step's micro-batches go through the model.

The single-stage default runs forward and backward per micro-batch (gradient accumulation). A pipeline schedule
implements the same protocol, so the `Trainer` does not change when pipeline parallelism arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import nn

from d9d.core.loop.protocols import TrainTask

TBatch = TypeVar("TBatch")


@dataclass(frozen=True, kw_only=True)
class ScheduleResult:
    """Local sums over this rank's micro-batches (detached; `loss_sum` float64 on the model's device, so the
    schedule itself never waits for the device)."""

    loss_sum: torch.Tensor
    metric_sums: dict[str, float]


class StepSchedule(Protocol):
    def run(
        self,
        model: nn.Module,
        task: TrainTask[TBatch],
        microbatches: Sequence[TBatch],
        *,
        loss_scale: float,
        backward: bool,
    ) -> ScheduleResult:
        """Forward (and, if `backward`, backward of `loss_sum * loss_scale`) every micro-batch."""
        ...


class AccumulationSchedule:
    """One stage, micro-batches one after another; gradients accumulate in `.grad` (or the sync's buckets)."""

    def run(
        self,
        model: nn.Module,
        task: TrainTask[TBatch],
        microbatches: Sequence[TBatch],
        *,
        loss_scale: float,
        backward: bool,
    ) -> ScheduleResult:
        total: torch.Tensor | None = None
        metric_sums: dict[str, float] = {}
        for batch in microbatches:
            with torch.set_grad_enabled(backward):
                result = task.compute_loss(model, batch)
            if backward:
                (result.loss_sum * loss_scale).backward()  # type: ignore[no-untyped-call]
            loss = result.loss_sum.detach().to(torch.float64)
            total = loss if total is None else total + loss
            for name, value in result.metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + float(value)
        if total is None:
            total = torch.zeros((), dtype=torch.float64)
        return ScheduleResult(loss_sum=total, metric_sums=metric_sums)
