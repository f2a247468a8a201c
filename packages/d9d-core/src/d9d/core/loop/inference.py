"""`Inference`: the Trainer's parts, forward only — held-out loss, perplexity and bits per byte."""

from __future__ import annotations

from typing import Generic, TypeVar

from torch import nn

from d9d.core.dist import DistributedContext
from d9d.core.loop.evaluation import EvaluationResult, evaluate
from d9d.core.loop.protocols import DataSource, TrainTask
from d9d.core.loop.reduce import token_group
from d9d.core.loop.schedule import AccumulationSchedule, StepSchedule

TBatch = TypeVar("TBatch")


class Inference(Generic[TBatch]):
    def __init__(
        self,
        ctx: DistributedContext | None,
        *,
        model: nn.Module,
        task: TrainTask[TBatch],
        data: DataSource[TBatch],
        schedule: StepSchedule | None = None,
    ) -> None:
        self.model, self.task, self.data = model, task, data
        self.schedule = schedule or AccumulationSchedule()
        self._group = token_group(ctx)
        self._device = ctx.device if ctx is not None else None

    def run(self, steps: int) -> EvaluationResult:
        """Evaluate `steps` steps of the data source (every rank its share); the result is global."""
        return evaluate(
            self.model,
            self.task,
            self.data,
            steps=steps,
            group=self._group,
            device=self._device,
            schedule=self.schedule,
        )
