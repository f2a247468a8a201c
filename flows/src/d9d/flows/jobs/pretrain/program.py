"""The pretrain rank program: `torchrun --nproc-per-node N -m d9d.flows.jobs.pretrain.program --config job.yaml`.

Every rank runs the same wiring: distributed context, the Qwen3 model provider (meta -> parallel plan ->
materialise -> optional `init_from` load through d9d-states), packed token-shard data through the resumable
data-parallel loader, optimizer and LR schedule from config, and the d9d-core `Trainer` (which resumes from the
newest complete checkpoint in `trainer.checkpointing.directory`). No Prefect here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from d9d.core.config import load_config
from d9d.core.data import DataParallelLoader, PackedTokenDataset, ShuffledOrder, collate_packed
from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    BuiltModel,
    EventBus,
    LoaderDataSource,
    LossResult,
    ModelLoader,
    StepFinished,
    TrainingStarted,
    TrainResult,
    build_trainer,
)
from d9d.core.lr import build_lr_scheduler
from d9d.core.optim import build_optimizer
from d9d.flows.jobs.launch import emit_progress, prepare_rank
from d9d.flows.jobs.optimizer_kernels import register_optimizer_kernels
from d9d.flows.jobs.pretrain.config import (
    AnyModelConfig,
    PretrainConfig,
    PretrainDataConfig,
    Qwen3DenseModelConfig,
    Qwen3MoeModelConfig,
)
from d9d.flows.jobs.weights import load_converted_weights
from d9d.metrics.trackers import build_tracker
from d9d.models import materialize_
from d9d.models.blocks.moe import aux_loss_weights
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
)
from d9d.parallel import AnyDataParallelConfig, clip_grad_norm_


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


class MoeBiasBalancer:
    """Auxiliary-loss-free balancing over d9d.models' MoE layers (those with a router expert bias)."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        self._layers = {
            name: module
            for name, module in model.named_modules()
            if hasattr(module, "tokens_per_expert") and getattr(module.router, "expert_bias", None) is not None
        }
        self._rate = rate

    def local_loads(self) -> dict[str, torch.Tensor]:
        return {name: layer.tokens_per_expert.clone() for name, layer in self._layers.items()}

    def apply(self, global_loads: Mapping[str, torch.Tensor]) -> None:
        for name, layer in self._layers.items():
            layer.router.update_expert_bias_(global_loads[name], self._rate)
            layer.reset_load()


def model_provider_for(
    model_config: AnyModelConfig,
    data_parallel: AnyDataParallelConfig,
    prepare: Callable[[nn.Module], object] | None = None,
) -> Any:
    """Meta -> `prepare` (e.g. PEFT injection) -> parallel plan -> materialise -> optional load; MoE models with a
    router bias get a balancer."""

    def provide(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        model: nn.Module
        match model_config:
            case Qwen3DenseModelConfig():
                with torch.device("meta"):
                    model = Qwen3DenseForCausalLM(model_config.parameters, config=model_config.decoder)
                if prepare is not None:
                    prepare(model)
                sync = parallelize_qwen3_dense(model, ctx, data_parallel)
                balancer = None
            case Qwen3MoeModelConfig():
                with torch.device("meta"):
                    model = Qwen3MoeForCausalLM(model_config.parameters, config=model_config.decoder)
                if prepare is not None:
                    prepare(model)
                sync = parallelize_qwen3_moe(model, ctx, data_parallel)
                balancer = MoeBiasBalancer(model, model_config.expert_bias_rate)
        materialize_(model, ctx.device)
        if loader is not None:
            loader(model)
        return BuiltModel(model=model, gradient_sync=sync, load_balancer=balancer, aux_losses=aux_loss_weights(model))

    return provide


def data_provider_for(data: PretrainDataConfig, global_batch_rows: int) -> Any:
    """Packed rows of a token-shard set, shuffled, endless, split over the data-parallel ranks."""

    def provide(ctx: DistributedContext, microbatches: int) -> LoaderDataSource:
        dataset = PackedTokenDataset(data.shards, seq_len=data.seq_len)
        layout = ctx.layout_for(MeshDomain.BATCH)
        loader = DataParallelLoader(
            dataset,
            order=ShuffledOrder(len(dataset), seed=data.shuffle_seed),
            global_batch_size=global_batch_rows,
            dp_rank=ctx.coordinate(MeshDomain.BATCH)["dp"],
            dp_size=layout.shape[layout.dim_names.index("dp")],
            collate_fn=collate_packed,
            epochs=None,
        )
        return LoaderDataSource(loader, microbatches)

    return provide


def run_pretrain(config: PretrainConfig, ctx: DistributedContext, events: EventBus | None = None) -> TrainResult:
    """Train on this rank (every rank of the job calls it with the same config); `events` sees the loop's events."""

    def optimizer_provider(model: nn.Module) -> Optimizer:
        register_optimizer_kernels(config.optimizer)
        return build_optimizer(config.optimizer, model.parameters())

    def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
        return build_lr_scheduler(config.lr_schedule, optimizer, total_steps)

    init_from = config.init_from
    loader: ModelLoader | None = None
    if init_from is not None:

        def load(model: nn.Module) -> None:
            load_converted_weights(init_from, model)

        loader = load

    tracker = build_tracker(
        config.tracker, enabled=ctx.is_main_process, hparams=config.model_dump(mode="json"), name="pretrain"
    )
    trainer = build_trainer(
        ctx,
        config.trainer,
        model_provider=model_provider_for(config.model, config.data_parallel),
        task=PackedCausalLMTask(),
        data_provider=data_provider_for(config.data, config.trainer.global_batch_rows),
        optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider,
        loader=loader,
        clipper=clip_grad_norm_,
        tracker=tracker,
        events=events,
    )
    result = trainer.train()
    tracker.close()  # only after a normal return: a crashed attempt must not flush steps it will replay
    return result


def report_progress(events: EventBus, total_steps: int) -> None:
    """Print each finished step as a launcher progress line (`d9d.flows.jobs.launch`); call it on rank 0."""

    def started(event: TrainingStarted) -> None:
        resumed = str(event.resumed_from) if event.resumed_from is not None else None
        emit_progress({"event": "started", "step": event.start_step, "total": total_steps, "resumed_from": resumed})

    def finished(event: StepFinished) -> None:
        emit_progress({"event": "step", "step": event.step, "total": total_steps, "loss": event.loss})

    events.subscribe(TrainingStarted, started)
    events.subscribe(StepFinished, finished)


def main(argv: Sequence[str] | None = None) -> int:
    prepare_rank()  # its Python stack on SIGUSR2, for the launcher's report of a failed group
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = load_config(PretrainConfig, args.config, args.overrides)
    timeout = timedelta(seconds=config.trainer.collective_timeout_s)
    with DistributedContext.build(config.degrees, device=config.device, timeout=timeout) as ctx:
        events = EventBus()
        if ctx.is_main_process:
            report_progress(events, config.trainer.total_steps)
        result = run_pretrain(config, ctx, events)
        ctx.logger.info("pretrain finished at step %d (preempted: %s)", result.last_step, result.preempted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
