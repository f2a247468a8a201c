"""The `Trainer`: one optimizer step per iteration over injected parts, with events, checkpoints and resume.

Per step: the data source gives this rank's micro-batches; their counted tokens are summed over every rank that holds
different tokens (data-parallel times context-parallel ranks) *before* forward; each micro-batch's summed loss is
scaled by one over that global count and backpropagated, so the summed (never averaged) data-parallel gradients equal
one big batch's exactly. Then gradient sync, clipping, the step's loss reduction, the non-finite guard, optimizer and
LR step, logging, validation, checkpoint. SIGTERM on any rank makes every rank finish the step, checkpoint and return.

The non-finite guard needs no synchronisation of its own: the gradient norm is already a host number identical on
every rank (the clipper reduces it over the whole mesh, and one rank's non-finite gradient makes it non-finite
everywhere), and the step's loss reduction over the data- and context-parallel ranks, which the loop always did to
log the loss, now runs before the optimizer step instead of after it (ranks outside that group, tensor-parallel peers,
compute the same loss). Every rank therefore takes the same skip-or-step decision from the same two numbers.
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

from d9d.core.checkpoint import JobCheckpointer, ModelAndOptimizer, checkpoint_dir, write_durable
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
    StepSkipped,
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
from d9d.core.loop.reduce import sum_over, token_group
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


class NonFiniteStepError(RuntimeError):
    """The loss or gradient norm was not finite and the `non_finite` policy says stop (the message names the step)."""


class TrainerStateError(ValueError):
    """A checkpoint's loop state (`trainer_state.json`) is not the JSON the loop writes."""


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
        self._group = token_group(ctx)  # sums of tokens, losses, metrics and expert loads
        self._dp_size = ctx.degrees.dp  # rows of the global batch split over these; cp ranks share their rows
        self._token_ranks = self._dp_size * ctx.degrees.cp
        config.microbatches_per_step(self._dp_size)  # fail now, naming the sizes, if the batch does not split
        self._validation_start = parts.validation_data.state_dict() if parts.validation_data is not None else {}
        checkpointing = config.checkpointing
        self._checkpointer = (
            JobCheckpointer(
                checkpointing.directory, keep_last=checkpointing.keep_last, rank=ctx.rank, device=ctx.device
            )
            if checkpointing is not None
            else None
        )
        self.skipped_steps = 0  # steps dropped by the non-finite guard, over the whole run (resumed too)
        self._consecutive_skips = 0
        self._parameters: list[nn.Parameter] | None = None  # see `_model_parameters`

    # Checkpoints -----------------------------------------------------------------------------------------------

    def _trainer_state(self) -> dict[str, Any]:
        tracker = self.parts.tracker
        return {
            "step": self.step,
            "data": self.parts.data.state_dict(),
            "lr_scheduler": self.parts.lr_scheduler.state_dict(),
            "tracker_run_id": tracker.run_id if tracker is not None else None,
            "dp_size": self._dp_size,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self._consecutive_skips,
        }

    def save_checkpoint(self) -> Path:
        if self._checkpointer is None:
            raise RuntimeError("TrainerConfig.checkpointing is not set")
        state = {"app": self._checkpoint_view()}
        trainer_state = self._trainer_state()

        def before_marker(path: Path) -> None:
            if self.ctx.is_main_process:
                write_durable(path / TRAINER_STATE_FILE, json.dumps(trainer_state, indent=1).encode("utf-8"))
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
        """Load exactly `path` (no fallback; resuming through `train()` falls back to older complete ones)."""
        assert self._checkpointer is not None
        self._checkpointer.load(path, {"app": self._checkpoint_view()})
        self._apply_trainer_state(_read_trainer_state(path))

    def _apply_trainer_state(self, trainer_state: Mapping[str, Any]) -> None:
        self.step = int(trainer_state["step"])
        self.skipped_steps = int(trainer_state.get("skipped_steps", 0))
        self._consecutive_skips = int(trainer_state.get("consecutive_skips", 0))
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
                preempted = preemption.agreed(self.ctx.control_group)
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
        loaded = self._checkpointer.load_newest({"app": self._checkpoint_view()}, _read_trainer_state)
        if loaded is None:
            return None
        path, trainer_state = loaded
        self._apply_trainer_state(trainer_state)
        return path

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
        params = self._model_parameters()
        for param in params:
            param.grad = None
        if parts.aux_losses is not None:
            # Every micro-batch routes the same number of tokens (rows x seq_len, a 1/cp share of it on each cp
            # rank), so their plain mean over all dp x cp ranks is the token-weighted mean: one big batch's z-loss,
            # the mean balance loss of the micro-batches' shards.
            parts.aux_losses.set_weight(1.0 / (len(microbatches) * self._token_ranks))
        parts.gradient_sync.begin_step(len(microbatches))
        result = parts.schedule.run(
            parts.model, parts.task, microbatches, loss_scale=1.0 / global_tokens, backward=True
        )
        parts.gradient_sync.wait()
        finished = ForwardBackwardFinished(
            step=step, num_microbatches=len(microbatches), data_parallel_group=self._group, device=self.ctx.device
        )
        self.events.emit(finished)  # subscribers may add to `finished.metrics` (e.g. expert loads)

        max_norm = self.config.max_grad_norm
        with_grads = [param for param in params if param.grad is not None]
        grad_norm = float(parts.clipper(with_grads, max_norm if max_norm is not None else math.inf))
        learning_rate = float(parts.optimizer.param_groups[0]["lr"])

        # The step's one loss reduction, before the optimizer step so the guard below can use it (see module doc).
        metric_sums = dict(result.metric_sums)
        if parts.aux_losses is not None:  # already weighted: the sum over ranks is the step's auxiliary loss
            metric_sums["aux_loss"] = parts.aux_losses.take_weighted_sum()
        names = sorted(metric_sums)
        sums = sum_over([float(result.loss_sum)] + [metric_sums[name] for name in names], self._group, self.ctx.device)
        loss = sums[0] / global_tokens

        stop_reason = None
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self._consecutive_skips = 0
            parts.optimizer.step()
            parts.lr_scheduler.step()
            self.events.emit(OptimizerStepped(step=step, grad_norm=grad_norm, learning_rate=learning_rate))
        else:
            stop_reason = self._skip_step(loss, grad_norm)

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
            "skipped_steps": float(self.skipped_steps),
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
        if stop_reason is not None:
            raise NonFiniteStepError(stop_reason)
        return loss

    def _model_parameters(self) -> list[nn.Parameter]:
        """The model's parameters, walked once, at the first step (after materialisation and resume). Walking the
        module tree costs about a millisecond of host time per call at the anchors' 311 parameters; the `Parameter`
        objects do not change after the model is built (moving storage, as `.data` assignment, `to()` and
        checkpoint loading do, keeps them). Clearing their gradients is the step's `zero_grad` (set to None), which
        also covers parameters the optimizer does not hold."""
        if self._parameters is None:
            self._parameters = list(self.parts.model.parameters())
        return self._parameters

    def _skip_step(self, loss: float, grad_norm: float) -> str | None:
        """Count a non-finite step as skipped (nothing was updated); returns why to stop, or None to go on."""
        self.skipped_steps += 1
        self._consecutive_skips += 1
        policy = self.config.non_finite
        self.events.emit(
            StepSkipped(step=self.step, loss=loss, grad_norm=grad_norm, consecutive=self._consecutive_skips)
        )
        what = f"step {self.step}: the loss is {loss} and the gradient norm {grad_norm} (not finite)"
        if policy.policy == "stop":
            return f"{what}; stopping (non_finite.policy='stop'); the parameters were not updated by this step"
        if self._consecutive_skips > policy.max_consecutive_skips:
            return (
                f"{what}; {self._consecutive_skips} non-finite steps in a row, more than "
                f"non_finite.max_consecutive_skips={policy.max_consecutive_skips} allows; stopping. Lower the "
                "learning rate, check the data, or resume from an earlier checkpoint"
            )
        return None

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


def _read_trainer_state(path: Path) -> dict[str, Any]:
    """The loop's state in checkpoint `path`: plain JSON, never unpickled.

    Raises:
        TrainerStateError: the file is missing, not JSON, or lacks the loop's keys.
    """
    file = path / TRAINER_STATE_FILE
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise TrainerStateError(f"{file}: not the loop's JSON state ({error})") from error
    missing = [key for key in ("step", "data", "lr_scheduler") if not isinstance(state, dict) or key not in state]
    if missing:
        raise TrainerStateError(f"{file}: the loop's state lacks {missing}")
    return dict(state)
