"""Variable-shape tensor gathers and object gathers on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from d9d.core.ops import all_gather_object, all_gather_variable_shape, gather_object, gather_variable_shape


def _rank_tensor(rank: int) -> torch.Tensor:
    # rank r holds r+1 rows of 3 columns, so every rank's shape differs (rank 0 holds one row)
    return torch.arange((rank + 1) * 3, dtype=torch.float32).reshape(rank + 1, 3) + 100 * rank


@pytest.mark.distributed(world_size=4)
def test_all_gather_variable_shape_returns_every_rank_tensor_with_its_shape():
    gathered = all_gather_variable_shape(_rank_tensor(dist.get_rank()))
    assert [tuple(t.shape) for t in gathered] == [(1, 3), (2, 3), (3, 3), (4, 3)]
    for rank, tensor in enumerate(gathered):
        assert torch.equal(tensor, _rank_tensor(rank))


@pytest.mark.distributed(world_size=4)
def test_gather_variable_shape_delivers_to_the_destination_only():
    gathered = gather_variable_shape(_rank_tensor(dist.get_rank()).to(torch.int64), dst=2)
    if dist.get_rank() == 2:
        assert gathered is not None
        assert [torch.equal(t, _rank_tensor(r).to(torch.int64)) for r, t in enumerate(gathered)] == [True] * 4
    else:
        assert gathered is None


@pytest.mark.distributed(world_size=2)
def test_empty_tensors_and_scalars_gather():
    rank = dist.get_rank()
    gathered = all_gather_variable_shape(torch.ones(rank * 2) if rank else torch.empty(0))
    assert [t.numel() for t in gathered] == [0, 2]
    scalars = all_gather_variable_shape(torch.tensor(float(rank)))
    assert [t.item() for t in scalars] == [0.0, 1.0]


@pytest.mark.distributed(world_size=2)
def test_mismatched_rank_count_is_a_clear_error():
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"rank 0: shape \[2\] torch.float32, rank 1: shape \[2, 2\] torch.float32"):
        all_gather_variable_shape(torch.zeros(2) if rank == 0 else torch.zeros(2, 2))


@pytest.mark.distributed(world_size=4)
def test_gathers_over_a_subgroup_use_group_rank_order():
    group = dist.new_group([1, 3])
    if dist.get_rank() in (1, 3):
        gathered = all_gather_variable_shape(_rank_tensor(dist.get_rank()), group=group)
        assert [t.shape[0] for t in gathered] == [2, 4]
        objects = gather_object({"rank": dist.get_rank()}, dst=3, group=group)
        assert objects == ([{"rank": 1}, {"rank": 3}] if dist.get_rank() == 3 else None)


@pytest.mark.distributed(world_size=3)
def test_object_gathers():
    rank = dist.get_rank()
    assert all_gather_object(("rank", rank, [rank] * rank)) == [("rank", r, [r] * r) for r in range(3)]
    gathered = gather_object(rank * 10, dst=0)
    assert gathered == ([0, 10, 20] if rank == 0 else None)
