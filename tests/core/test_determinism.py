"""Seeding follows the documented rule, and a parameter initialised while sharded equals single-process init."""

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from d9d.core.determinism import init_parameter_, seed_everything, stage_seed, use_deterministic_algorithms
from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.core.ops import all_gather_object


def _single_process_init(seed: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    first = torch.empty(shape)
    nn.init.normal_(first, std=0.02)
    second = torch.empty(shape)
    nn.init.kaiming_uniform_(second, a=5**0.5)
    return first, second


@pytest.mark.distributed(world_size=4)
def test_sharded_initialisation_equals_single_process_initialisation():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, tp=2))
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_cp_shard", "tp"]
    seed_everything(1234, ctx)
    first = distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0), Shard(1)])
    second = distribute_tensor(torch.zeros(16, 8), mesh, [Replicate(), Shard(0)])
    init_parameter_(first, lambda t: nn.init.normal_(t, std=0.02))
    init_parameter_(second, lambda t: nn.init.kaiming_uniform_(t, a=5**0.5))
    # Exact equality: the same RNG stream draws the same values; only the slicing differs.
    reference_first, reference_second = _single_process_init(1234, (16, 8))
    assert torch.equal(first.full_tensor(), reference_first)
    assert torch.equal(second.full_tensor(), reference_second)
    # and shards really differ from each other (the naive CPU behaviour would repeat one block on every rank)
    blocks = all_gather_object(first.to_local().clone())
    assert not torch.equal(blocks[0], blocks[1])


@pytest.mark.distributed(world_size=4)
def test_seed_rule_is_seed_plus_pipeline_rank():
    ctx = DistributedContext.build(MeshDegrees(pp=2, dp_shard=2))
    used = seed_everything(7, ctx)
    assert used == stage_seed(7, ctx.pp_rank) == 7 + ctx.rank // 2
    draws = all_gather_object((random.random(), float(np.random.rand()), torch.rand(1).item()))
    # ranks of one stage draw the same; the two stages draw differently
    assert draws[0] == draws[1] and draws[2] == draws[3] and draws[0] != draws[2]
    dist.barrier()


def test_deterministic_mode_toggles_torch_setting():
    try:
        use_deterministic_algorithms(True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        use_deterministic_algorithms(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_plain_tensors_are_initialised_directly():
    torch.manual_seed(3)
    tensor = init_parameter_(torch.empty(4, 4), nn.init.ones_)
    assert torch.equal(tensor, torch.ones(4, 4))
