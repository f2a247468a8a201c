"""Context-parallel batch preparation: shards of the load-balanced layout, positions computed on the full rows,
every sequence tensor sliced alike, and the sequence-length check that preflight runs (naming the degrees)."""

import pytest
import torch

from d9d.core.dist import MeshDegrees
from d9d.parallel.context import (
    ContextParallelDataSource,
    check_context_parallel,
    positions_within_documents,
    shard_batch_for_context,
    shard_sequence,
    unshard_sequence,
)


def _batch():
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])
    return {
        "input_ids": torch.arange(16).view(2, 8),
        "labels": torch.arange(100, 116).view(2, 8),
        "document_ids": document_ids,
        "meta": "kept",
    }


def test_shards_carry_positions_of_the_full_rows_and_slice_every_sequence_tensor():
    batch = _batch()
    shards = [shard_batch_for_context(batch, rank, 2) for rank in range(2)]
    assert shards[0]["input_ids"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]  # chunks 0 and 3
    assert shards[1]["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]  # chunks 1 and 2
    # Position 6 of row 0 is the 4th token of document 1: computed on the full row, not on the shard.
    assert shards[0]["position_ids"].tolist() == [[0, 1, 3, 4], [0, 1, 0, 1]]
    full_positions = unshard_sequence([shard["position_ids"] for shard in shards])
    assert torch.equal(full_positions, positions_within_documents(batch["document_ids"]))
    assert shards[1]["meta"] == "kept"


def test_given_positions_are_sliced_not_recomputed_and_no_documents_means_arange():
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.arange(10, 18)[None]}
    assert shard_batch_for_context(batch, 1, 2)["position_ids"].tolist() == [[12, 13, 14, 15]]
    plain = shard_batch_for_context({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, 0, 4)
    assert plain["position_ids"].tolist() == [[0, 7]]


def test_sequence_length_must_split_into_two_chunks_per_cp_rank():
    with pytest.raises(ValueError, match=r"sequence length 10 cannot be split over cp=2.*multiple of 2\*cp=4"):
        shard_sequence(torch.zeros(1, 10), 0, 2)
    check_context_parallel(4096, MeshDegrees(dp_shard=2, cp=4))
    with pytest.raises(ValueError, match=r"multiple of 2\*cp=8 \(e.g. 4088 or 4096\) \(pp=1, .*cp=4"):
        check_context_parallel(4090, MeshDegrees(dp_shard=2, cp=4))
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        shard_batch_for_context({"tokens": torch.zeros(1, 8)}, 0, 2)


def test_data_source_shards_each_microbatch_and_keeps_the_inner_position():
    class Source:
        def __init__(self):
            self.steps = 0

        def next_step(self):
            self.steps += 1
            return [_batch(), _batch()]

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    source = ContextParallelDataSource(Source(), cp_rank=1, cp=2)
    microbatches = source.next_step()
    assert [mb["input_ids"].shape for mb in microbatches] == [torch.Size([2, 4])] * 2
    assert source.state_dict() == {"steps": 1}
    source.load_state_dict({"steps": 7})
    assert source.state_dict() == {"steps": 7}
