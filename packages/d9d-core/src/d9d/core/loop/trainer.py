"""The `Trainer`: one optimizer step per iteration over injected parts, with events, checkpoints and resume.

Per step: the data source gives this rank's micro-batches; their counted tokens are summed over data-parallel ranks
*before* forward; each micro-batch's summed loss is scaled by one over that global count and backpropagated, so
the summed (never averaged) data-parallel gradients equal one big batch's exactly. Then gradient sync, clipping,
optimizer and LR step, logging, validation, checkpoint. SIGTERM on any rank makes every rank finish the step,
checkpoint and return.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from d9d.core.checkpoint import JobCheckpointer, ModelAndOptimizer, checkpoint_dir
from d9d.core.dist import DistributedContext
from d9d.core.loop.config import TrainerConfig
from d9d.core.loop.defaults import clip_grad_norm_torch
from d9d.core.loop.evaluation import evaluate
from d9d.core.loop.events import (
    CheckpointSaved,
    CheckpointStarted,
    CheckpointWritten,
    EventBus,
    ForwardBackwardFinished,
    OptimizerStepped,
    StepFinished,
    StepStarted,
    TrainingFinished,
    TrainingStarted,
    ValidationFinished,
)
from d9d.core.loop.measures import mfu, peak_memory_gib
from d9d.core.loop.preemption import PreemptionFlag
from d9d.core.loop.profiling import StepProfiler
from d9d.core.loop.protocols import (
    AuxLossWeighting,
    DataSource,
    Exporter,
    GradientClipper,
    GradientSync,
    Tracker,
    TrainTask,
)
from d9d.core.loop.reduce import dp_group, sum_over
from d9d.core.loop.schedule import AccumulationSchedule, StepSchedule

TBatch = TypeVar("TBatch")

TRAINER_STATE_FILE = "trainer_state.json"


@dataclass(kw_only=True)
class TrainerParts(Generic[TBatch]):
    """Everything the loop drives, already built (see `d9d.core.loop.wiring.build_trainer` for the providers)."""

    model: nn.Module
    gradient_sync: GradientSync
    optimizer: Optimizer
    lr_scheduler: LRScheduler
    data: DataSource[TBatch]
    task: TrainTask[TBatch]
    validation_data: DataSource[TBatch] | None = None
    schedule: StepSchedule = field(default_factory=AccumulationSchedule)
    clipper: GradientClipper = clip_grad_norm_torch
    tracker: Tracker | None = None
    flops_per_token: float | None = None
    aux_losses: AuxLossWeighting | None = None


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    last_step: int
    preempted: bool
    resumed_from: Path | None
    losses: dict[int, float]


class Trainer(Generic[TBatch]):
    def __init__(
        self,
        ctx: DistributedContext,
        config: TrainerConfig,
        parts: TrainerParts[TBatch],
        *,
        events: EventBus | None = None,
    ) -> None:
        self.ctx = ctx
        self.config = config
        self.parts = parts
        self.events = events or EventBus()
        self.step = 0
        self._group = dp_group(ctx)
        self._dp_size = ctx.world_size if self._group is None else self._group.size()
        config.microbatches_per_step(self._dp_size)  # fail now, naming the sizes, if the batch does not split
        self._validation_start = parts.validation_data.state_dict() if parts.validation_data is not None else {}
        checkpointing = config.checkpointing
        self._checkpointer = (
            JobCheckpointer(checkpointing.directory, keep_last=checkpointing.keep_last, rank=ctx.rank)
            if checkpointing is not None
            else None
        )

    # Checkpoints -----------------------------------------------------------------------------------------------

    def _trainer_state(self) -> dict[str, Any]:
        tracker = self.parts.tracker
        return {
            "step": self.step,
            "data": self.parts.data.state_dict(),
            "lr_scheduler": self.parts.lr_scheduler.state_dict(),
            "tracker_run_id": tracker.run_id if tracker is not None else None,
            "dp_size": self._dp_size,
        }

    def save_checkpoint(self) -> Path:
        if self._checkpointer is None:
            raise RuntimeError("TrainerConfig.checkpointing is not set")
        state = {"app": self._checkpoint_view()}
        trainer_state = self._trainer_state()

        def before_marker(path: Path) -> None:
            if self.ctx.is_main_process:
                (path / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, indent=1), encoding="utf-8")
            self.events.emit(CheckpointWritten(step=self.step, path=path))

        self.events.emit(CheckpointStarted(step=self.step, path=checkpoint_dir(self._checkpointer.root, self.step)))
        path = self._checkpointer.save(self.step, state, before_marker=before_marker)
        if self.parts.tracker is not None:
            self.parts.tracker.checkpointed(self.step)  # after the marker: these steps are never replayed now
        self.events.emit(CheckpointSaved(step=self.step, path=path))
        return path

    def _checkpoint_view(self) -> ModelAndOptimizer:
        checkpointing = self.config.checkpointing
        trainable_only = checkpointing is not None and checkpointing.trainable_only
        return ModelAndOptimizer(self.parts.model, self.parts.optimizer, trainable_only=trainable_only)

    def load_checkpoint(self, path: Path) -> None:
        assert self._checkpointer is not None
        self._checkpointer.load(path, {"app": self._checkpoint_view()})
        trainer_state: Mapping[str, Any] = json.loads((path / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
        self.step = int(trainer_state["step"])
        self.parts.data.load_state_dict(trainer_state["data"])
        self.parts.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
        run_id = trainer_state.get("tracker_run_id")
        if self.parts.tracker is not None and run_id:
            self.parts.tracker.resume(run_id, self.step)  # steps after this one were logged by the dead attempt

    def export(self, exporter: Exporter) -> None:
        """Hand the (trained) model to `exporter`, e.g. a d9d-states writer to the Hugging Face layout."""
        exporter(self.parts.model)

    # The loop --------------------------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        resumed_from = self._maybe_resume()
        self.events.emit(
            TrainingStarted(start_step=self.step, total_steps=self.config.total_steps, resumed_from=resumed_from)
        )
        preemption = PreemptionFlag()
        preemption.install()
        manual_gc = self.config.gc_every is not None
        if manual_gc:
            gc.disable()
        losses: dict[int, float] = {}
        preempted = False
        profiler = (
            StepProfiler(self.config.profiling, rank=self.ctx.rank, device=self.ctx.device)
            if self.config.profiling is not None
            else None
        )
        if profiler is not None:
            profiler.start()
        try:
            self.parts.model.train()
            while self.step < self.config.total_steps:
                self.step += 1
                losses[self.step] = self._train_step()
                if profiler is not None:
                    profiler.step(self.step)
                if manual_gc and self.step % (self.config.gc_every or 1) == 0:
                    gc.collect()
                self._maybe_validate()
                preempted = preemption.agreed(self.ctx.device)
                if self._checkpoint_due(preempted):
                    self.save_checkpoint()
                if preempted:
                    break
        finally:
            if profiler is not None:
                profiler.stop()
            preemption.uninstall()
            if manual_gc:
                gc.enable()
        self.events.emit(TrainingFinished(step=self.step, preempted=preempted))
        return TrainResult(last_step=self.step, preempted=preempted, resumed_from=resumed_from, losses=losses)

    def _maybe_resume(self) -> Path | None:
        checkpointing = self.config.checkpointing
        if self._checkpointer is None or checkpointing is None or not checkpointing.resume:
            return None
        latest = self._checkpointer.latest()
        if latest is not None:
            self.load_checkpoint(latest)
        return latest

    def _checkpoint_due(self, preempted: bool) -> bool:
        checkpointing = self.config.checkpointing
        if checkpointing is None:
            return False
        periodic = checkpointing.every_steps is not None and self.step % checkpointing.every_steps == 0
        return preempted or periodic or self.step == self.config.total_steps

    def _train_step(self) -> float:
        parts, step = self.parts, self.step
        self.events.emit(StepStarted(step=step))
        started = time.perf_counter()
        microbatches = parts.data.next_step()
        local_tokens = sum(parts.task.count_tokens(batch) for batch in microbatches)
        (global_tokens,) = sum_over([float(local_tokens)], self._group, self.ctx.device)
        if global_tokens == 0:
            raise ValueError(f"step {step}: the global batch has no counted tokens (every label ignored?)")
        parts.optimizer.zero_grad(set_to_none=True)
        if parts.aux_losses is not None:
            # Every micro-batch routes the same number of tokens (rows x seq_len), so their plain mean over all
            # ranks is the token-weighted mean: one big batch's z-loss, the micro-batches' mean balance loss.
            parts.aux_losses.set_weight(1.0 / (len(microbatches) * self._dp_size))
        parts.gradient_sync.begin_step(len(microbatches))
        result = parts.schedule.run(
            parts.model, parts.task, microbatches, loss_scale=1.0 / global_tokens, backward=True
        )
        parts.gradient_sync.wait()
        finished = ForwardBackwardFinished(
            step=step, num_microbatches=len(microbatches), data_parallel_group=self._group, device=self.ctx.device
        )
        self.events.emit(finished)  # subscribers may add to `finished.metrics` (e.g. expert loads)

        params = [param for param in parts.model.parameters() if param.grad is not None]
        max_norm = self.config.max_grad_norm
        grad_norm = float(parts.clipper(params, max_norm if max_norm is not None else math.inf))
        learning_rate = float(parts.optimizer.param_groups[0]["lr"])
        parts.optimizer.step()
        parts.lr_scheduler.step()
        self.events.emit(OptimizerStepped(step=step, grad_norm=grad_norm, learning_rate=learning_rate))

        metric_sums = dict(result.metric_sums)
        if parts.aux_losses is not None:  # already weighted: the sum over ranks is the step's auxiliary loss
            metric_sums["aux_loss"] = parts.aux_losses.take_weighted_sum()
        names = sorted(metric_sums)
        sums = sum_over([float(result.loss_sum)] + [metric_sums[name] for name in names], self._group, self.ctx.device)
        loss = sums[0] / global_tokens
        elapsed = time.perf_counter() - started
        tokens_per_second = global_tokens / elapsed
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": learning_rate,
            "tokens": global_tokens,
            "tokens_per_second": tokens_per_second,
            "step_seconds": elapsed,
            "peak_memory_gib": peak_memory_gib(self.ctx.device),
            **dict(zip(names, sums[1:], strict=True)),
            **finished.metrics,
        }
        utilisation = mfu(
            tokens_per_second, parts.flops_per_token, self.config.peak_flops_per_device, self.ctx.world_size
        )
        if utilisation is not None:
            metrics["mfu"] = utilisation
        if parts.tracker is not None and step % self.config.log_every == 0:
            parts.tracker.log(step, metrics)
        self.events.emit(StepFinished(step=step, loss=loss, metrics=metrics))
        return loss

    def _maybe_validate(self) -> None:
        every, data = self.config.validation_every, self.parts.validation_data
        if every is None or data is None or self.step % every:
            return
        data.load_state_dict(self._validation_start)  # the same held-out batches every time
        result = evaluate(
            self.parts.model,
            self.parts.task,
            data,
            steps=self.config.validation_steps,
            group=self._group,
            device=self.ctx.device,
            schedule=self.parts.schedule,
        )
        if self.parts.tracker is not None:
            validation = {"validation_loss": result.loss, "validation_perplexity": result.perplexity}
            self.parts.tracker.log(self.step, validation)
        self.events.emit(
            ValidationFinished(step=self.step, loss=result.loss, perplexity=result.perplexity, tokens=result.tokens)
        )
