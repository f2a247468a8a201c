"""The pretrain rank program: `torchrun --nproc-per-node N -m d9d.flows.jobs.pretrain.program --config job.yaml`.

Every rank runs the same wiring: distributed context, the model from d9d-models' catalogue on the section's
topology (`build_rank_model`: meta -> tp/cp/ep/data-parallel plan -> materialise -> optional `init_weights` load
through d9d-states; this rank's pipeline stages and schedule at `pp > 1`), packed token-shard data through
`build_data_loader` (each cp rank its shard of every row), optimizer and LR schedule from the section, and the
d9d-core `Trainer` (which resumes from the newest complete checkpoint in `checkpoints`). No Prefect here.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from d9d.core.config import load_config
from d9d.core.data.loader_config import ShuffledOrderConfig
from d9d.core.dist import DistributedContext
from d9d.core.loop import BuiltModel, DataSource, EventBus, ModelLoader, TrainResult, build_trainer
from d9d.core.lr import build_lr_scheduler
from d9d.core.optim import build_optimizer
from d9d.flows.jobs.launch import prepare_rank
from d9d.flows.jobs.optimizer_kernels import register_optimizer_kernels
from d9d.flows.jobs.pretrain.config import PretrainRankConfig
from d9d.flows.jobs.rank_wiring import (
    build_rank_model,
    data_parallel_size,
    gradient_clipper,
    log_topology,
    packed_loader,
    packed_source,
    packed_task,
    report_progress,
)
from d9d.flows.jobs.weights import load_converted_weights
from d9d.metrics.trackers import build_tracker


def run_pretrain(config: PretrainRankConfig, ctx: DistributedContext, events: EventBus | None = None) -> TrainResult:
    """Train on this rank (every rank of the job calls it with the same config); `events` sees the loop's events."""
    stage = config.stage

    trainer_config = stage.trainer_config(config.checkpoints)

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        microbatches = trainer_config.microbatches_per_step(data_parallel_size(ctx))
        return build_rank_model(stage, stage.model, ctx, microbatches_per_step=microbatches, loader=loader)

    def data_provider(ctx: DistributedContext, microbatches_per_step: int) -> DataSource[Any]:
        loader = packed_loader(
            ctx,
            config.train_shards,
            seq_len=stage.seq_len,
            global_batch_rows=stage.global_batch_rows,
            order=ShuffledOrderConfig(seed=stage.shuffle_seed),
            epochs=None,
        )
        return packed_source(ctx, loader, microbatches_per_step)

    def optimizer_provider(model: nn.Module) -> Optimizer:
        register_optimizer_kernels(stage.optimizer)
        return build_optimizer(stage.optimizer, model.parameters())

    def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
        return build_lr_scheduler(stage.lr_schedule, optimizer, total_steps)

    init_weights = config.init_weights
    loader: ModelLoader | None = None
    if init_weights is not None:

        def load(model: nn.Module) -> None:
            load_converted_weights(init_weights, model, pipeline_stages=ctx.degrees.pp > 1)

        loader = load

    tracker = build_tracker(
        config.tracker, enabled=ctx.is_main_process, hparams=config.model_dump(mode="json"), name="pretrain"
    )
    trainer = build_trainer(
        ctx,
        trainer_config,
        model_provider=model_provider,
        task=packed_task(stage, stage.model),
        data_provider=data_provider,
        optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider,
        loader=loader,
        clipper=gradient_clipper(ctx),
        tracker=tracker,
        events=events,
    )
    result = trainer.train()
    tracker.close()  # only after a normal return: a crashed attempt must not flush steps it will replay
    return result


def main(argv: Sequence[str] | None = None) -> int:
    prepare_rank()  # its Python stack on SIGUSR2, for the launcher's report of a failed group
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = load_config(PretrainRankConfig, args.config, args.overrides)  # the one validation in this process
    stage = config.stage
    timeout = timedelta(seconds=stage.trainer_config(config.checkpoints).collective_timeout_s)
    with DistributedContext.build(stage.degrees, device=stage.device, timeout=timeout) as ctx:
        events = EventBus()
        if ctx.is_main_process:
            report_progress(events, stage.steps)
        log_topology("pretrain", stage, ctx)
        result = run_pretrain(config, ctx, events)
        ctx.logger.info("pretrain finished at step %d (preempted: %s)", result.last_step, result.preempted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
