"""The Trainer on 2 gloo ranks with a `MetricLogger` attached to its events: metrics updated inside the task are
synchronised asynchronously (started when a step finishes, fetched when the next one does) and logged per step.

Parity: the synced perplexity of a step is exp of the Trainer's own loss of that step (the token-weighted mean of
the global batch, itself a sum over ranks), and the synced token count is the Trainer's `tokens`. Both sides add
the same float64 numbers in another order, hence rel=1e-12.
"""

from __future__ import annotations

import json
import math

import pytest
import torch.distributed as dist
from torch import nn
from tracker_rank_program import TokenTask, provide_data, provide_lr, provide_model, provide_optimizer

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import (
    CheckpointingConfig,
    CheckpointStarted,
    EventBus,
    LossResult,
    StepFinished,
    TokenBatch,
    TrainerConfig,
    TrainingFinished,
    build_trainer,
)
from d9d.core.loop.reduce import dp_group
from d9d.metrics import MetricLogger, PerplexityMetric, SumMetric, TokenCountMetric
from d9d.metrics.trackers import JsonlTracker


class MeasuredTask(TokenTask):
    def __init__(self) -> None:
        self.perplexity, self.tokens = PerplexityMetric(), TokenCountMetric()

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        result = super().compute_loss(model, batch)
        self.perplexity.update(result.loss_sum.detach(), self.count_tokens(batch))
        self.tokens.update(self.count_tokens(batch))
        return result


@pytest.mark.distributed(world_size=2, timeout=120)
def test_metrics_logged_from_trainer_events_equal_the_trainers_global_figures(tmp_path):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=-1), device="cpu")
    task = MeasuredTask()
    tracker = JsonlTracker(tmp_path / "metrics", enabled=ctx.is_main_process, run_id="run")
    events = EventBus()
    trainer_figures: dict[int, dict[str, float]] = {}
    events.subscribe(StepFinished, lambda event: trainer_figures.__setitem__(event.step, event.metrics))
    logger = MetricLogger(
        {"perplexity": task.perplexity, "tokens": task.tokens}, tracker, group=dp_group(ctx), prefix="task/"
    )
    logger.attach(events)
    config = TrainerConfig(
        total_steps=6, global_batch_rows=4, microbatch_rows=1, gc_every=None,
        checkpointing=CheckpointingConfig(directory=tmp_path / "checkpoints", every_steps=3),
    )  # fmt: skip
    build_trainer(
        ctx, config, model_provider=provide_model, task=task, data_provider=provide_data,
        optimizer_provider=provide_optimizer, lr_scheduler_provider=provide_lr, tracker=tracker, events=events,
    ).train()  # fmt: skip

    assert sorted(logger.logged) == list(range(1, 7))
    for step, results in logger.logged.items():
        assert results["perplexity"] == pytest.approx(math.exp(trainer_figures[step]["loss"]), rel=1e-12)
        assert results["tokens"] == trainer_figures[step]["tokens"]
    dist.barrier()
    if ctx.is_main_process:  # a row of trainer metrics and (a step later) one of task metrics per step
        rows = [json.loads(line) for line in tracker.path.read_text().splitlines()]
        assert sorted(row["step"] for row in rows if "task/perplexity" in row) == list(range(1, 7))
        assert sorted(row["step"] for row in rows if "loss" in row) == list(range(1, 7))


@pytest.mark.distributed(world_size=2, timeout=60)
def test_with_every_above_one_nothing_updated_is_lost_before_a_checkpoint_or_at_the_end(tmp_path):
    """every=4 over 6 steps, a checkpoint after step 3: the sync before the checkpoint takes steps 1-3, step 4's
    regular sync takes step 4, the end takes steps 5-6; only the latest `keep_results` stay in `logged`."""
    rank = dist.get_rank()
    tracker = JsonlTracker(tmp_path / "metrics", enabled=rank == 0, run_id="run")
    tokens, events = SumMetric(), EventBus()
    logger = MetricLogger({"tokens": tokens}, tracker, every=4, keep_results=2)
    logger.attach(events)
    for step in range(1, 7):
        tokens.update(100.0 * (rank + 1))  # 300 tokens per step over both ranks
        events.emit(StepFinished(step=step, loss=0.0))
        if step == 3:
            events.emit(CheckpointStarted(step=3, path=tmp_path / "checkpoint-3"))
    events.emit(TrainingFinished(step=6, preempted=False))
    assert {step: results["tokens"] for step, results in logger.logged.items()} == {4: 300.0, 6: 600.0}
    dist.barrier()
    if rank == 0:
        rows = [json.loads(line) for line in tracker.path.read_text().splitlines()]
        assert [(row["step"], row["tokens"]) for row in rows] == [(3, 900.0), (4, 300.0), (6, 600.0)]  # all 1800
