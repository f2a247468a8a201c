"""Optimizer configuration builds AdamW or stochastic AdamW; both step DTensor parameters without communicating."""

import pytest
import torch
import torch.distributed as dist
from pydantic import TypeAdapter, ValidationError
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.core.optim import AnyOptimizerConfig, StochasticAdamW, build_optimizer

ADAPTER = TypeAdapter(AnyOptimizerConfig)


def test_configs_build_their_optimizer_with_the_given_hyperparameters():
    params = [torch.nn.Parameter(torch.ones(2))]
    adamw = build_optimizer(ADAPTER.validate_python({"kind": "adamw", "lr": 0.1, "weight_decay": 0.0}), params)
    assert isinstance(adamw, torch.optim.AdamW)
    assert (adamw.param_groups[0]["lr"], adamw.param_groups[0]["weight_decay"]) == (0.1, 0.0)
    stochastic = build_optimizer(
        ADAPTER.validate_json('{"kind": "stochastic_adamw", "seed": 3, "state_dtype": "bfloat16"}'), params
    )
    assert isinstance(stochastic, StochasticAdamW)
    assert (stochastic.seed, stochastic.state_dtype) == (3, torch.bfloat16)


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        ({"kind": "adam"}, "expected tags: 'adamw', 'stochastic_adamw'"),
        ({"kind": "adamw", "momentum": 0.9}, "Extra inputs are not permitted"),
        ({"kind": "adamw", "lr": -1}, "greater than or equal to 0"),
        ({"kind": "stochastic_adamw", "state_dtype": "float16"}, "'float32' or 'bfloat16'"),
    ],
)
def test_bad_configs_are_rejected_with_the_field(raw, complaint):
    with pytest.raises(ValidationError, match=complaint):
        ADAPTER.validate_python(raw)


@pytest.mark.parametrize("kind", ["adamw", "stochastic_adamw"])
@pytest.mark.distributed(world_size=4)
def test_a_single_rank_can_step_sharded_and_replicated_parameters_alone(kind):
    # If a step communicated, the one rank stepping alone would block in a collective the others never join.
    mesh = DistributedContext.build(MeshDegrees(dp_replicate=2, dp_shard=2)).mesh_for(MeshDomain.DENSE)
    mesh = mesh["dp_replicate", "dp_cp_shard"]
    dtype = torch.bfloat16 if kind == "stochastic_adamw" else torch.float32
    placements = [(Replicate(), Shard(0)), (Replicate(), Replicate())]
    params = [
        torch.nn.Parameter(distribute_tensor(torch.ones(8, 2, dtype=dtype), mesh, list(spec))) for spec in placements
    ]
    optimizer = build_optimizer(ADAPTER.validate_python({"kind": kind, "lr": 0.5}), params)
    for param, spec in zip(params, placements, strict=True):
        param.grad = distribute_tensor(torch.ones(8, 2, dtype=dtype), mesh, list(spec))
    if dist.get_rank() == 1:
        optimizer.step()
        assert all(bool((param.to_local() < 1).all()) for param in params)
    dist.barrier()
