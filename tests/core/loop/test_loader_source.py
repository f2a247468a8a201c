"""The Trainer over real token shards (packed rows, shuffled global order): resuming continues the loader exactly."""

import numpy as np
import pytest
from loop_workload import VOCAB, TinyModelProvider, lr_provider, optimizer_provider
from torch import nn

from d9d.core.data import DataParallelLoader, PackedTokenDataset, ShuffledOrder, TokenShardSetWriter, collate_packed
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import (
    CheckpointingConfig,
    CheckpointSaved,
    EventBus,
    LoaderDataSource,
    LossResult,
    TrainerConfig,
    build_trainer,
)


class PackedLMTask:
    def count_tokens(self, batch):
        return int((batch["labels"] != -100).sum())

    def compute_loss(self, model: nn.Module, batch) -> LossResult:
        output = model(
            batch["input_ids"],
            position_ids=batch["position_ids"],
            document_ids=batch["document_ids"],
            labels=batch["labels"],
        )
        return LossResult(loss_sum=output.losses.sum())


class Crash(Exception):
    pass


def _crash_after_checkpoint(event: CheckpointSaved) -> None:
    if event.step == 3:
        raise Crash


def _trainer(ctx, shards, checkpoints, total_steps, events=None):
    dataset = PackedTokenDataset(shards, seq_len=12)

    def data_provider(ctx, microbatches):
        loader = DataParallelLoader(
            dataset, order=ShuffledOrder(len(dataset), seed=1), global_batch_size=4, dp_rank=0, dp_size=1,
            collate_fn=collate_packed, epochs=None,
        )  # fmt: skip
        return LoaderDataSource(loader, microbatches)

    config = TrainerConfig(
        total_steps=total_steps, global_batch_rows=4, microbatch_rows=2, seed=3,
        checkpointing=CheckpointingConfig(directory=checkpoints, every_steps=3),
    )  # fmt: skip
    return build_trainer(
        ctx, config, model_provider=TinyModelProvider("dense", "none"), task=PackedLMTask(),
        data_provider=data_provider, optimizer_provider=optimizer_provider, lr_scheduler_provider=lr_provider,
        events=events,
    )  # fmt: skip


@pytest.mark.distributed(world_size=1, timeout=120)
def test_resume_from_a_checkpoint_continues_the_loader_bitwise(tmp_path):
    rng = np.random.default_rng(0)
    with TokenShardSetWriter(tmp_path / "shards", dtype="uint16", max_shard_tokens=100) as writer:
        for _ in range(30):
            writer.add_document(rng.integers(0, VOCAB, size=int(rng.integers(3, 20))), num_bytes=10)
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    uninterrupted = _trainer(ctx, tmp_path / "shards", tmp_path / "a", total_steps=6).train().losses
    events = EventBus()
    events.subscribe(CheckpointSaved, _crash_after_checkpoint)
    with pytest.raises(Crash):
        _trainer(ctx, tmp_path / "shards", tmp_path / "b", total_steps=6, events=events).train()
    resumed = _trainer(ctx, tmp_path / "shards", tmp_path / "b", total_steps=6).train()
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step-00000003"
    assert {step: resumed.losses[step] for step in (4, 5, 6)} == {step: uninterrupted[step] for step in (4, 5, 6)}
