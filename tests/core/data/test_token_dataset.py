"""Datasets over the token-shard format: documents and packed rows read lazily across shard files."""

import numpy as np
import pytest
import torch

from d9d.core.data import (
    DataParallelLoader,
    PackedTokenDataset,
    SequentialOrder,
    TokenDocumentDataset,
    TokenShardSetWriter,
    collate_packed,
    pack_documents,
)


@pytest.fixture
def shard_dir(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 50_000, size=int(rng.integers(0, 40))) for _ in range(60)]
    with TokenShardSetWriter(tmp_path, dtype="uint16", max_shard_tokens=200) as writer:
        for tokens in documents:
            writer.add_document(tokens, num_bytes=len(tokens))
    return tmp_path, [torch.from_numpy(tokens.astype(np.int64)) for tokens in documents]


def test_documents_read_back_across_shards_with_their_lengths(shard_dir):
    path, documents = shard_dir
    dataset = TokenDocumentDataset(path)
    assert len(dataset.shards.shards) > 1
    assert len(dataset) == len(documents)
    for index in (0, 17, 59):
        assert dataset[index].dtype == torch.int64
        torch.testing.assert_close(dataset[index], documents[index])
    assert dataset.lengths.tolist() == [len(tokens) for tokens in documents]
    truncated = TokenDocumentDataset(path, max_length=10)
    assert truncated.lengths.max() == 10 and len(truncated[int(np.argmax(dataset.lengths))]) == 10


@pytest.mark.parametrize("mode", ["split", "whole"])
def test_packed_rows_equal_packing_the_documents_in_memory(shard_dir, mode):
    path, documents = shard_dir
    dataset = PackedTokenDataset(path, 32, mode=mode)
    expected = pack_documents(documents, 32, mode=mode)
    assert len(dataset) == len(expected)
    for index in range(len(dataset)):
        for field in ("input_ids", "labels", "position_ids", "document_ids"):
            assert torch.equal(getattr(dataset[index], field), getattr(expected[index], field)), (index, field)


def test_packed_rows_load_in_data_parallel_batches(shard_dir):
    path, _ = shard_dir
    dataset = PackedTokenDataset(path, 32)
    loader = DataParallelLoader(
        dataset,
        order=SequentialOrder(len(dataset)),
        global_batch_size=4,
        dp_rank=1,
        dp_size=2,
        collate_fn=collate_packed,
    )
    batch = next(iter(loader))
    assert batch["input_ids"].shape == batch["document_ids"].shape == (2, 32)
    assert torch.equal(batch["input_ids"][0], dataset[2].input_ids)
