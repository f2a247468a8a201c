"""Experts at efsdp = 1 (`shard_experts` where the FSDP dimension has one rank) on gloo: no FSDP unit, an enclosing
dense unit leaves them alone, forward computes on bfloat16 copies and gradients land in float32 on the `Shard(0)`
DTensor parameters.

The reference is each rank's slice of the full weight run through the same bfloat16 ops in one process; the
gradients must be equal bit for bit (the same ops on the same values, nothing reduced: at efsdp = 1 each expert's
gradient lives on its owner only).
"""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.parallel import parallelize_fsdp, shard_experts
from d9d.parallel.mixed_precision import BF16_COMPUTE_FP32_REDUCE
from d9d.parallel.placed import placed_by

NUM_EXPERTS, IN, OUT = 4, 5, 3


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(NUM_EXPERTS, OUT, IN, generator=torch.Generator().manual_seed(0)))
        self.seen_dtypes: list[torch.dtype] = []

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # rows: (local experts, IN), one row per local expert
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        self.seen_dtypes.append(weight.dtype)
        return (weight @ rows.unsqueeze(-1)).squeeze(-1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(IN, IN)
        self.experts = _Experts()

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.dense(x).sum() + self.experts(rows).float().sum()


@pytest.mark.distributed(world_size=2, timeout=120)
def test_experts_at_efsdp_1_have_no_fsdp_unit_and_train_in_mixed_precision():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, ep=2))
    block = _Block()
    full = block.experts.weight.detach().clone()
    mesh = ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep"]
    unit = shard_experts(block.experts, mesh, num_experts=NUM_EXPERTS, mixed_precision=BF16_COMPUTE_FP32_REDUCE)
    parallelize_fsdp(block, ctx.mesh_for(MeshDomain.DENSE)["dp_cp_shard"], mixed_precision=BF16_COMPUTE_FP32_REDUCE)

    weight = block.experts.weight
    assert unit is None and not isinstance(block.experts, FSDPModule) and isinstance(block, FSDPModule)
    assert isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == ("ep",)
    assert weight.placements == (Shard(0),) and weight.dtype == torch.float32
    assert placed_by(block.experts, "weight") == "expert parallelism"
    # The dense unit sharded its own parameter over the dense data ranks, and only that one.
    assert isinstance(block.dense.weight, DTensor) and block.dense.weight.device_mesh.mesh_dim_names == ("dp_cp_shard",)

    rank = ctx.rank
    rows = torch.randn(NUM_EXPERTS // 2, IN, generator=torch.Generator().manual_seed(10 + rank))
    block(torch.randn(2, IN), rows).backward()
    assert block.experts.seen_dtypes == [torch.bfloat16]
    assert block.experts.weight is weight  # the parameter is back after forward

    local = full[rank * 2 : rank * 2 + 2].clone().requires_grad_(True)
    reference = (local.to(torch.bfloat16) @ rows.to(torch.bfloat16).unsqueeze(-1)).squeeze(-1)
    reference.float().sum().backward()
    grad = weight.grad
    assert isinstance(grad, DTensor) and grad.placements == (Shard(0),) and grad.dtype == torch.float32
    assert torch.equal(grad.to_local(), local.grad)
