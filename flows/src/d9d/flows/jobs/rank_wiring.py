"""What the rank programs (pretrain, finetune, evaluate) share: the packed causal-LM task, packed token-shard
loading through d9d-core's `build_data_loader`, and the progress lines rank 0 prints for the launcher."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from d9d.core.data import DataParallelLoader, PackedSequence, PackedTokenDataset, collate_packed
from d9d.core.data.loader_config import AnySampleOrderConfig, DataLoaderConfig, build_data_loader
from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import EventBus, LossResult, StepFinished, TrainingStarted
from d9d.flows.jobs.launch import emit_progress


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
