"""Triton backends given tensor-parallel DTensors fall back to the eager reference (the ops have no sharding rules)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from triton_cases import requires_triton

from d9d.kernels.rms_norm import TritonRmsNorm, rms_norm_reference
from d9d.kernels.swiglu import TritonSwiGlu, swiglu_reference

pytestmark = requires_triton


@pytest.mark.distributed(world_size=2, timeout=120)
def test_dtensor_inputs_run_the_eager_path_with_the_same_result():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(4, 8, generator=generator), torch.randn(8, generator=generator)
    gate, up = torch.randn(4, 6, generator=generator), torch.randn(4, 6, generator=generator)
    out, _ = TritonRmsNorm()(
        distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(weight, mesh, [Replicate()]), eps=1e-6
    )
    assert isinstance(out, DTensor)
    torch.testing.assert_close(out.full_tensor(), rms_norm_reference(x, weight, eps=1e-6)[0])
    act = TritonSwiGlu()(distribute_tensor(gate, mesh, [Shard(1)]), distribute_tensor(up, mesh, [Shard(1)]))
    torch.testing.assert_close(act.full_tensor(), swiglu_reference(gate, up))
