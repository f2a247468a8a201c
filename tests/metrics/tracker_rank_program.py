"""Rank program for the tracker kill/resume test: `torchrun --nproc-per-node 2 tracker_rank_program.py --out DIR`.

Trains a tiny token model (embedding -> linear, gradients all-reduced over the ranks) with the d9d-core Trainer
for `--steps` steps, checkpointing every `--every`, and logs the Trainer's metrics to four trackers at once (JSON
lines, TensorBoard, aim, wandb offline) built from config on every rank with `enabled` on the main process only.
`--kill-at S` SIGKILLs every rank mid-step S (after backward). Rank 0 appends each finished step's loss to
`DIR/losses.jsonl` (the ground truth the trackers are compared with; a replayed step keeps its last value).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    BuiltModel,
    CheckpointingConfig,
    EventBus,
    ForwardBackwardFinished,
    LossResult,
    ModelLoader,
    StepFinished,
    SyntheticTokenSource,
    TokenBatch,
    TrainerConfig,
    build_trainer,
)
from d9d.metrics.trackers import (
    AimTrackerConfig,
    JsonlTrackerConfig,
    TensorBoardTrackerConfig,
    TrackerGroup,
    WandbTrackerConfig,
    build_tracker,
)

VOCAB, SEQ = 32, 8


class AllReduceGradients:
    """Plain data parallelism: sum the gradients over every rank after backward."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    def begin_step(self, num_microbatches: int) -> None:
        del num_microbatches

    def wait(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            for param in self._model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)


class TokenTask:
    def count_tokens(self, batch: TokenBatch) -> int:
        return int((batch.labels != -100).sum())

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        logits = model(batch.input_ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch.labels.reshape(-1), reduction="sum")
        return LossResult(loss_sum=loss)


def provide_model(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
    return BuiltModel(model=model, gradient_sync=AllReduceGradients(model))


def provide_data(ctx: DistributedContext, microbatches_per_step: int) -> SyntheticTokenSource:
    layout = ctx.layout_for(MeshDomain.BATCH)
    return SyntheticTokenSource(
        seed=1, global_rows=4, microbatch_rows=1, seq_len=SEQ, vocab_size=VOCAB,
        dp_rank=ctx.coordinate(MeshDomain.BATCH)["dp"], dp_size=layout.shape[layout.dim_names.index("dp")],
        ignore_fraction=0.2,
    )  # fmt: skip


def provide_optimizer(model: nn.Module) -> Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def provide_lr(optimizer: Optimizer, total_steps: int) -> LRScheduler:
    return LambdaLR(optimizer, lambda step: 1.0 - step / (total_steps + 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args()

    ctx = DistributedContext.build(MeshDegrees(dp_shard=-1), device="cpu")
    events = EventBus()
    if args.kill_at is not None:
        events.subscribe(
            ForwardBackwardFinished,
            lambda event: os.kill(os.getpid(), signal.SIGKILL) if event.step == args.kill_at else None,
        )
    if ctx.is_main_process:
        args.out.mkdir(parents=True, exist_ok=True)

        def record(event: StepFinished) -> None:
            with (args.out / "losses.jsonl").open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": event.step, "loss": event.loss}) + "\n")

        events.subscribe(StepFinished, record)

    hparams = {"model": {"vocab": VOCAB, "hidden": 16}, "optimizer": {"lr": 1e-2}, "steps": args.steps}
    configs = [
        JsonlTrackerConfig(directory=args.out / "jsonl"),
        TensorBoardTrackerConfig(directory=args.out / "tensorboard"),
        AimTrackerConfig(repo=args.out / "aim", experiment="kill-resume"),
        WandbTrackerConfig(directory=args.out / "wandb", group="kill-resume"),
    ]
    tracker = TrackerGroup(
        [build_tracker(config, enabled=ctx.is_main_process, hparams=hparams, name="train") for config in configs]
    )
    config = TrainerConfig(
        total_steps=args.steps, global_batch_rows=4, microbatch_rows=1, seed=7, gc_every=None,
        checkpointing=CheckpointingConfig(directory=args.out / "checkpoints", every_steps=args.every),
    )  # fmt: skip
    trainer = build_trainer(
        ctx, config, model_provider=provide_model, task=TokenTask(), data_provider=provide_data,
        optimizer_provider=provide_optimizer, lr_scheduler_provider=provide_lr, tracker=tracker, events=events,
    )  # fmt: skip
    trainer.train()
    tracker.close()
    ctx.close()


if __name__ == "__main__":
    main()
