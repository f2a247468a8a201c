"""What the rank programs (pretrain, finetune, evaluate) share: the packed causal-LM task, packed token-shard
loading through d9d-core's `build_data_loader`, the progress lines rank 0 prints for the launcher, and for the two
training programs their command line and the Trainer around their model."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from d9d.core.data import DataParallelLoader, PackedSequence, PackedTokenDataset, collate_packed
from d9d.core.data.loader_config import (
    AnySampleOrderConfig,
    DataLoaderConfig,
    ShuffledOrderConfig,
    build_data_loader,
)
from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    EventBus,
    LoaderDataSource,
    LossResult,
    ModelLoader,
    ModelProvider,
    StepFinished,
    Tracker,
    Trainer,
    TrainingStarted,
    build_trainer,
)
from d9d.core.lr import build_lr_scheduler
from d9d.core.optim import build_optimizer
from d9d.flows.jobs.launch import emit_progress, prepare_rank
from d9d.flows.jobs.optimizer_kernels import register_optimizer_kernels
from d9d.flows.jobs.torchrun_stage import TrainingStageConfig
from d9d.parallel import clip_grad_norm_


class PackedCausalLMTask:
    """Packed rows (`collate_packed`): documents attend within themselves; loss summed over counted tokens."""

    def count_tokens(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int((batch["labels"] != -100).sum())

    def compute_loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> LossResult:
        device = next(model.parameters()).device
        output = model(
            batch["input_ids"].to(device),
            position_ids=batch["position_ids"].to(device),
            document_ids=batch["document_ids"].to(device),
            labels=batch["labels"].to(device),
        )
        return LossResult(loss_sum=output.losses.sum())


def data_parallel_size(ctx: DistributedContext) -> int:
    layout = ctx.layout_for(MeshDomain.BATCH)
    return layout.shape[layout.dim_names.index("dp")]


def packed_loader(
    ctx: DistributedContext,
    shards: Path,
    *,
    seq_len: int,
    global_batch_rows: int,
    order: AnySampleOrderConfig,
    epochs: int | None,
) -> DataParallelLoader[PackedSequence]:
    """Packed rows of a token-shard set, this data-parallel rank's share of each global batch."""
    dataset = PackedTokenDataset(shards, seq_len=seq_len)
    config = DataLoaderConfig(global_batch_size=global_batch_rows, order=order, epochs=epochs)
    return build_data_loader(
        config,
        dataset,
        dp_rank=ctx.coordinate(MeshDomain.BATCH)["dp"],
        dp_size=data_parallel_size(ctx),
        collate_fn=collate_packed,
    )


def report_progress(events: EventBus, total_steps: int) -> None:
    """Print each finished step as a launcher progress line (`d9d.flows.jobs.launch`); call it on rank 0."""

    def started(event: TrainingStarted) -> None:
        resumed = str(event.resumed_from) if event.resumed_from is not None else None
        emit_progress({"event": "started", "step": event.start_step, "total": total_steps, "resumed_from": resumed})

    def finished(event: StepFinished) -> None:
        emit_progress({"event": "step", "step": event.step, "total": total_steps, "loss": event.loss})

    events.subscribe(TrainingStarted, started)
    events.subscribe(StepFinished, finished)


def build_stage_trainer(
    ctx: DistributedContext,
    stage: TrainingStageConfig,
    *,
    checkpoints: Path,
    train_shards: Path,
    seq_len: int,
    model_provider: ModelProvider,
    loader: ModelLoader | None,
    tracker: Tracker,
    events: EventBus | None,
    trainable_only: bool = False,
) -> Trainer[Any]:
    """The Trainer a training section describes around `model_provider`'s model: packed rows of `train_shards` in the
    section's shuffled order, its optimizer over the parameters that train (a fine-tune's adapters only), its LR
    schedule, exact grad-norm clipping, job checkpoints in `checkpoints` (`trainable_only`: the trained parameters
    alone, the base being loaded anew)."""

    def data_provider(ctx: DistributedContext, microbatches_per_step: int) -> LoaderDataSource:
        order = ShuffledOrderConfig(seed=stage.shuffle_seed)
        rows = stage.global_batch_rows
        loader = packed_loader(ctx, train_shards, seq_len=seq_len, global_batch_rows=rows, order=order, epochs=None)
        return LoaderDataSource(loader, microbatches_per_step)

    def optimizer_provider(model: nn.Module) -> Optimizer:
        register_optimizer_kernels(stage.optimizer)
        return build_optimizer(stage.optimizer, [param for param in model.parameters() if param.requires_grad])

    def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
        return build_lr_scheduler(stage.lr_schedule, optimizer, total_steps)

    return build_trainer(
        ctx,
        stage.trainer_config(checkpoints, trainable_only=trainable_only),
        model_provider=model_provider,
        task=PackedCausalLMTask(),
        data_provider=data_provider,
        optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider,
        loader=loader,
        clipper=clip_grad_norm_,
        tracker=tracker,
        events=events,
    )


class TrainingRankConfig(Protocol):
    """What a training rank program's config holds: its stage section and where its job checkpoints go."""

    @property
    def stage(self) -> TrainingStageConfig: ...

    @property
    def checkpoints(self) -> Path: ...


RankConfig = TypeVar("RankConfig", bound=TrainingRankConfig)


def training_rank_main(
    argv: Sequence[str] | None,
    description: str,
    load: Callable[[Path, Sequence[str]], RankConfig],
    train: Callable[[RankConfig, DistributedContext, EventBus], str],
) -> int:
    """A training rank program's command line (`--config job.yaml [--set KEY=VALUE ...]`): its config loaded by
    `load` (the one validation in this process), the distributed context its section describes, progress lines from
    rank 0, and `train`, whose returned line is logged."""
    prepare_rank()  # its Python stack on SIGUSR2, for the launcher's report of a failed group
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = load(args.config, args.overrides)
    stage = config.stage
    timeout = timedelta(seconds=stage.trainer_config(config.checkpoints).collective_timeout_s)
    with DistributedContext.build(stage.degrees, device=stage.device, timeout=timeout) as ctx:
        events = EventBus()
        if ctx.is_main_process:  # progress lines for the launcher (the stage's bar and losses file)
            report_progress(events, stage.steps)
        ctx.logger.info("%s", train(config, ctx, events))
    return 0
