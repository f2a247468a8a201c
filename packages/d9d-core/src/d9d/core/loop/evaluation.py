"""Forward-only evaluation: token-weighted loss, perplexity and bits per byte over a number of steps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.loop.protocols import DataSource, TrainTask
from d9d.core.loop.reduce import sum_over
from d9d.core.loop.schedule import AccumulationSchedule, StepSchedule

TBatch = TypeVar("TBatch")


@dataclass(frozen=True, kw_only=True)
class EvaluationResult:
    loss: float  # nats per counted token, token-weighted over every rank and batch
    perplexity: float
    tokens: int
    bits_per_byte: float | None  # when the task counts bytes


def evaluate(
    model: nn.Module,
    task: TrainTask[TBatch],
    data: DataSource[TBatch],
    *,
    steps: int,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
    schedule: StepSchedule | None = None,
) -> EvaluationResult:
    """Run `steps` steps of `data` forward only (model in eval mode, restored afterwards)."""
    schedule = schedule or AccumulationSchedule()
    count_bytes = getattr(task, "count_bytes", None)
    loss_sum, tokens, num_bytes = 0.0, 0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(steps):
                microbatches = data.next_step()
                tokens += sum(task.count_tokens(batch) for batch in microbatches)
                if count_bytes is not None:
                    num_bytes += sum(int(count_bytes(batch)) for batch in microbatches)
                result = schedule.run(model, task, microbatches, loss_scale=1.0, backward=False)
                loss_sum += float(result.loss_sum)
    finally:
        model.train(was_training)
    total_loss, total_tokens, total_bytes = sum_over([loss_sum, float(tokens), float(num_bytes)], group, device)
    if total_tokens == 0:
        raise ValueError("evaluation saw no counted tokens (every label ignored?)")
    loss = total_loss / total_tokens
    return EvaluationResult(
        loss=loss,
        perplexity=math.exp(min(loss, 700.0)),
        tokens=int(total_tokens),
        bits_per_byte=total_loss / (math.log(2) * total_bytes) if total_bytes > 0 else None,
    )
