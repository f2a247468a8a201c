"""The rank programs' packed loader pins its batches on CUDA ranks only (`DataLoaderConfig.pin_memory`): pinned
batches make the task's non-blocking host-to-device copies overlap the GPU's work; on CPU ranks nothing changes."""

from datetime import timedelta

import numpy as np
import pytest

from d9d.core.data import SequentialOrderConfig, TokenShardSetWriter
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.flows.jobs.rank_wiring import packed_loader


def _first_batch(tmp_path, device):
    shards = tmp_path / "shards"
    rng = np.random.default_rng(0)
    with TokenShardSetWriter(shards, dtype="uint16", max_shard_tokens=2000) as writer:
        for _ in range(20):
            writer.add_document(rng.integers(0, 64, size=40), num_bytes=40)
    with DistributedContext.build(MeshDegrees(dp_shard=-1), device=device, timeout=timedelta(minutes=2)) as ctx:
        loader = packed_loader(ctx, shards, seq_len=16, global_batch_rows=4, order=SequentialOrderConfig(), epochs=1)
        return loader, next(iter(loader))


@pytest.mark.distributed(world_size=1, init_process_group=False)
def test_cpu_ranks_get_unpinned_batches(tmp_path):
    loader, batch = _first_batch(tmp_path, "cpu")
    assert not loader.pin_memory
    assert batch["input_ids"].shape == (4, 16) and not batch["input_ids"].is_pinned()


@pytest.mark.gpu
@pytest.mark.distributed(world_size=1, init_process_group=False)
def test_cuda_ranks_get_pinned_batches(tmp_path):
    loader, batch = _first_batch(tmp_path, "cuda")
    assert loader.pin_memory
    assert all(tensor.is_pinned() for tensor in batch.values())
