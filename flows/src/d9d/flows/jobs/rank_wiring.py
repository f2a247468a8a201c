"""What the rank programs (pretrain, finetune, evaluate) share: the packed causal-LM task, packed token-shard
loading through d9d-core's `build_data_loader`, the model on the stage's topology (`build_rank_model`: every degree
and its options reach d9d-models' `build_model` here, once), context-parallel batches, the clipper, the
progress lines rank 0 prints for the launcher, and for the two training programs their command line and the
Trainer around their model."""

from __future__ import annotations

import argparse
import functools
import sys
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
    BuiltModel,
    DataSource,
    EventBus,
    GradientClipper,
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
from d9d.flows.jobs.offload_checks import offloaded_optimizer
from d9d.flows.jobs.optimizer_kernels import register_optimizer_kernels
from d9d.flows.jobs.topology import RankTopology
from d9d.flows.jobs.torchrun_stage import TrainingStageConfig
from d9d.models.catalogue import AnyModelConfig, build_model
from d9d.parallel import clip_grad_norm_, compute_device
from d9d.parallel.config import dtype_from_name
from d9d.parallel.context import ContextParallelDataSource
from d9d.pipeline import ActivationSpec, PipelineStage, pipeline_group

PackedBatch = Mapping[str, torch.Tensor]


def _on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on `device` without waiting for the device: a blocking host-to-device copy synchronizes the stream,
    so every micro-batch (and every pipeline forward) would wait for all the work queued before it, and the host
    could never run ahead of the GPU. Non-blocking is safe from any host memory: from pageable memory CUDA stages the
    source before the call returns; from pinned memory (`DataLoaderConfig.pin_memory`) torch's caching host allocator
    keeps the buffer until the copy has run."""
    return tensor.to(device, non_blocking=True)


class PackedCausalLMTask:
    """Packed rows (`collate_packed`): documents attend within themselves; loss summed over counted tokens.

    Pipelined (`degrees.pp > 1`), every stage gets the micro-batch's positions and document ids (each stage's
    attention masks documents), the first its tokens, the last its labels; stages hand over `(rows, seq / tp,
    hidden)` activations (under tensor parallelism each rank's sequence shard, design note 0016) of `activation_dtype`
    (the compute dtype: the data-parallel mixed-precision `param_dtype`, else float32)."""

    def __init__(
        self, hidden_size: int, activation_dtype: torch.dtype = torch.float32, *, sequence_shards: int = 1
    ) -> None:
        self.hidden_size, self.activation_dtype, self.sequence_shards = hidden_size, activation_dtype, sequence_shards

    def count_tokens(self, batch: PackedBatch) -> int:
        return int((batch["labels"] != -100).sum())

    def compute_loss(self, model: nn.Module, batch: PackedBatch) -> LossResult:
        device = compute_device(model)  # not the parameters' device: CPU-offloaded FSDP units compute on the GPU
        output = model(
            _on(device, batch["input_ids"]),
            position_ids=_on(device, batch["position_ids"]),
            document_ids=_on(device, batch["document_ids"]),
            labels=_on(device, batch["labels"]),
        )
        return LossResult(loss_sum=output.loss_sum)

    def forward_stage(
        self, module: nn.Module, batch: PackedBatch, *, stage: PipelineStage, hidden: torch.Tensor | None
    ) -> torch.Tensor | LossResult:
        device = compute_device(module)
        output = module(
            _on(device, batch["input_ids"]) if stage.is_first else None,
            hidden_states=hidden,
            position_ids=_on(device, batch["position_ids"]),
            document_ids=_on(device, batch["document_ids"]),
            labels=_on(device, batch["labels"]) if stage.is_last else None,
        )
        if stage.is_last:
            return LossResult(loss_sum=output.loss_sum)
        hidden_states: torch.Tensor = output.hidden_states
        return hidden_states

    def activation_spec(self, batch: PackedBatch, *, stage: PipelineStage) -> ActivationSpec:
        rows, seq = batch["input_ids"].shape
        shape = (rows, seq // self.sequence_shards, self.hidden_size)
        return ActivationSpec(shape=shape, dtype=self.activation_dtype)


def packed_task(topology: RankTopology, model: AnyModelConfig) -> PackedCausalLMTask:
    """The task for `model` on `topology` (the activation shape and dtype its pipeline stages hand over)."""
    precision = topology.data_parallel.mixed_precision
    dtype = dtype_from_name(precision.param_dtype) if precision is not None else None
    return PackedCausalLMTask(
        hidden_size=model.parameters.hidden_size,
        activation_dtype=dtype or torch.float32,
        sequence_shards=topology.degrees.tp,
    )


def build_rank_model(
    topology: RankTopology,
    model: AnyModelConfig,
    ctx: DistributedContext,
    *,
    microbatches_per_step: int | None = None,
    prepare: Callable[[nn.Module], object] | None = None,
    loader: ModelLoader | None = None,
) -> BuiltModel:
    """`model` on `ctx` with every option of `topology`: tensor parallelism, context-parallel attention, expert
    parallelism (by `ep`), data parallelism, and at `pp > 1` this rank's pipeline stages and their schedule
    (`microbatches_per_step` micro-batches; 1 for a forward-only pass)."""
    return build_model(
        model,
        ctx,
        topology.data_parallel,
        prepare=prepare,
        loader=loader,
        tensor_parallel=topology.tensor_parallel,
        context=topology.context_parallel,
        pipeline=topology.pipeline,
        num_microbatches=microbatches_per_step,
    )


def describe_topology(topology: RankTopology, ctx: DistributedContext) -> str:
    """The degrees a rank runs with (and the pipeline schedule at `pp > 1`), for the rank log."""
    text = ctx.degrees.describe()
    if ctx.degrees.pp > 1:
        text += f", pipeline schedule {topology.pipeline.schedule.kind}"
    return text


def log_topology(program: str, topology: RankTopology, ctx: DistributedContext) -> None:
    """Rank 0 states the degrees the job runs with in the launch log (`pretrain on pp=1, ..., tp=2, ep=1`)."""
    if ctx.is_main_process:
        sys.stdout.write(f"{program} on {describe_topology(topology, ctx)}\n")
        sys.stdout.flush()


def context_sharded(ctx: DistributedContext, source: DataSource[Any]) -> DataSource[Any]:
    """`source` (this data-parallel rank's micro-batches), each cp rank taking its shard of every sequence with
    global positions (the loss and the token count are then this shard's; the loop sums them over dp x cp)."""
    if ctx.degrees.cp == 1:
        return source
    return ContextParallelDataSource(source, cp_rank=ctx.coordinate(MeshDomain.BATCH)["cp"], cp=ctx.degrees.cp)


def packed_source(
    ctx: DistributedContext, loader: DataParallelLoader[PackedSequence], microbatches_per_step: int
) -> DataSource[Any]:
    """A packed loader's micro-batches, context-sharded when `cp > 1`."""
    return context_sharded(ctx, LoaderDataSource(loader, microbatches_per_step))


def gradient_clipper(ctx: DistributedContext) -> GradientClipper:
    """d9d-parallel's exact clipping; over every pipeline stage's parameters when `pp > 1`."""
    group = pipeline_group(ctx)
    if group is None:
        return clip_grad_norm_
    return functools.partial(clip_grad_norm_, across=group)


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
    """Packed rows of a token-shard set, this data-parallel rank's share of each global batch.

    On CUDA ranks the batches come in pinned host memory, so that `_on`'s non-blocking copies overlap the GPU's work;
    on CPU ranks pinning would only hold memory (and needs CUDA)."""
    dataset = PackedTokenDataset(shards, seq_len=seq_len)
    config = DataLoaderConfig(
        global_batch_size=global_batch_rows, order=order, epochs=epochs, pin_memory=ctx.device_type == "cuda"
    )
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
    task: PackedCausalLMTask,
    loader: ModelLoader | None,
    tracker: Tracker,
    events: EventBus | None,
    trainable_only: bool = False,
) -> Trainer[Any]:
    """The Trainer a training section describes around `model_provider`'s model: packed rows of `train_shards` in the
    section's shuffled order, its optimizer over the parameters that train (a fine-tune's adapters only), its LR
    schedule, exact grad-norm clipping, job checkpoints in `checkpoints` (`trainable_only`: the trained parameters
    alone, the base being loaded anew)."""

    def data_provider(ctx: DistributedContext, microbatches_per_step: int) -> DataSource[Any]:
        order = ShuffledOrderConfig(seed=stage.shuffle_seed)
        rows = stage.global_batch_rows
        loader = packed_loader(ctx, train_shards, seq_len=seq_len, global_batch_rows=rows, order=order, epochs=None)
        return packed_source(ctx, loader, microbatches_per_step)

    def optimizer_provider(model: nn.Module) -> Optimizer:
        register_optimizer_kernels(stage.optimizer)
        optimizer = offloaded_optimizer(stage.optimizer, stage.data_parallel)
        return build_optimizer(optimizer, [param for param in model.parameters() if param.requires_grad])

    def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
        return build_lr_scheduler(stage.lr_schedule, optimizer, total_steps)

    return build_trainer(
        ctx,
        stage.trainer_config(checkpoints, trainable_only=trainable_only),
        model_provider=model_provider,
        task=task,
        data_provider=data_provider,
        optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider,
        loader=loader,
        clipper=gradient_clipper(ctx),
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
    name: str,
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
        log_topology(name, stage, ctx)
        ctx.logger.info("%s", train(config, ctx, events))
    return 0
