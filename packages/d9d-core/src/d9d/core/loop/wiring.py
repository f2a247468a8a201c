"""Build a `Trainer` or an `Inference` from providers, in one fixed order: seed, model, optimizer, LR, data."""

from __future__ import annotations

from typing import TypeVar

from d9d.core.determinism import seed_everything
from d9d.core.dist import DistributedContext
from d9d.core.loop.config import TrainerConfig
from d9d.core.loop.defaults import clip_grad_norm_torch
from d9d.core.loop.events import EventBus
from d9d.core.loop.protocols import (
    DataProvider,
    GradientClipper,
    LRSchedulerProvider,
    ModelLoader,
    ModelProvider,
    OptimizerProvider,
    Tracker,
    TrainTask,
)
from d9d.core.loop.reduce import dp_group
from d9d.core.loop.schedule import AccumulationSchedule, StepSchedule
from d9d.core.loop.trainer import Trainer, TrainerParts

TBatch = TypeVar("TBatch")


def dp_size_of(ctx: DistributedContext) -> int:
    group = dp_group(ctx)
    return 1 if group is None else group.size()


def build_trainer(
    ctx: DistributedContext,
    config: TrainerConfig,
    *,
    model_provider: ModelProvider,
    task: TrainTask[TBatch],
    data_provider: DataProvider[TBatch],
    optimizer_provider: OptimizerProvider,
    lr_scheduler_provider: LRSchedulerProvider,
    validation_provider: DataProvider[TBatch] | None = None,
    loader: ModelLoader | None = None,
    clipper: GradientClipper = clip_grad_norm_torch,
    schedule: StepSchedule | None = None,
    tracker: Tracker | None = None,
    events: EventBus | None = None,
) -> Trainer[TBatch]:
    seed_everything(config.seed, ctx)
    built = model_provider(ctx, loader)
    optimizer = optimizer_provider(built.model)
    lr_scheduler = lr_scheduler_provider(optimizer, config.total_steps)
    microbatches = config.microbatches_per_step(dp_size_of(ctx))
    parts = TrainerParts(
        model=built.model,
        gradient_sync=built.gradient_sync,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        data=data_provider(ctx, microbatches),
        task=task,
        validation_data=validation_provider(ctx, microbatches) if validation_provider is not None else None,
        schedule=schedule or built.schedule or AccumulationSchedule(),
        clipper=clipper,
        tracker=tracker,
        flops_per_token=built.flops_per_token,
        aux_losses=built.aux_losses,
    )
    trainer = Trainer(ctx, config, parts, events=events)
    for subscriber in built.subscribers:
        subscriber.subscribe(trainer.events)
    return trainer
