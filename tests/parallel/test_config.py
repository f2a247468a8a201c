"""Data-parallel configuration: a discriminated union with unknown keys rejected, built into a gradient sync."""

import pytest
import torch
from pydantic import TypeAdapter, ValidationError
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.parallel import (
    AnyDataParallelConfig,
    FsdpConfig,
    GradientSync,
    GradientSynchronizer,
    HsdpConfig,
    ModuleGradientSync,
    ReplicateConfig,
    build_data_parallel,
    parallelize_fsdp,
    parallelize_hsdp,
)

ADAPTER = TypeAdapter(AnyDataParallelConfig)


def test_configs_parse_by_kind_and_round_trip_through_json():
    config = ADAPTER.validate_python(
        {"kind": "hsdp", "units": ["layers.*"], "mixed_precision": {"param_dtype": "bfloat16"}}
    )
    assert isinstance(config, HsdpConfig)
    assert config.mixed_precision.build().param_dtype == torch.bfloat16
    assert ADAPTER.validate_json(ADAPTER.dump_json(config)) == config
    assert isinstance(ADAPTER.validate_python({"kind": "replicate", "grad_dtype": "float32"}), ReplicateConfig)


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        ({"kind": "ddp"}, "does not match any of the expected tags: 'replicate', 'fsdp', 'hsdp'"),
        ({"kind": "fsdp", "unit": ["layers.*"]}, "Extra inputs are not permitted"),
        ({"kind": "replicate", "bucket_size_mb": 0}, "greater than 0"),
        ({"kind": "replicate", "grad_dtype": "fp32"}, "'float32', 'bfloat16' or 'float16'"),
    ],
)
def test_bad_configs_name_the_field_and_the_valid_values(raw, complaint):
    with pytest.raises(ValidationError, match=complaint):
        ADAPTER.validate_python(raw)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _dp_mesh(**degrees):
    return DistributedContext.build(MeshDegrees(**degrees)).mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard"]


@pytest.mark.distributed(world_size=4)
def test_each_kind_builds_its_style_and_sync():
    replicated = _model()
    sync = build_data_parallel(ReplicateConfig(), replicated, _dp_mesh(dp_replicate=2, dp_shard=2))
    assert isinstance(sync, GradientSynchronizer) and isinstance(sync, GradientSync)
    assert replicated[0].weight.placements == (Replicate(), Replicate())

    sharded = _model()
    sync = build_data_parallel(FsdpConfig(units=["0", "2"]), sharded, _dp_mesh(dp_shard=4))
    assert isinstance(sync, ModuleGradientSync)
    assert all(isinstance(sharded[index], FSDPModule) for index in (0, 2)) and isinstance(sharded, FSDPModule)
    assert sharded[0].weight.placements == (Shard(0),)

    hybrid = _model()
    build_data_parallel(HsdpConfig(), hybrid, _dp_mesh(dp_replicate=2, dp_shard=2))
    assert hybrid[0].weight.placements == (Replicate(), Shard(0))
    assert not isinstance(hybrid[0], FSDPModule), "no units configured: the root is the only unit"


@pytest.mark.distributed(world_size=4)
def test_mesh_mistakes_fail_with_the_dimensions_and_a_fix():
    mesh = _dp_mesh(dp_replicate=2, dp_shard=2)
    with pytest.raises(ValueError, match=r"kind='fsdp' shards over 'dp_cp_shard' only.*use kind='hsdp'"):
        build_data_parallel(FsdpConfig(), _model(), mesh)
    with pytest.raises(ValueError, match=r"shard_dim='dp_shard' is not a dimension.*valid: dp_replicate, dp_cp_shard"):
        build_data_parallel(HsdpConfig(shard_dim="dp_shard"), _model(), mesh)
    with pytest.raises(ValueError, match="parallelize_fsdp needs a 1-D mesh"):
        parallelize_fsdp(_model(), mesh)


@pytest.mark.distributed(world_size=8, timeout=90)
def test_hsdp_refuses_two_replicate_dimensions():
    ctx = DistributedContext.build(MeshDegrees(dp_replicate=2, dp_shard=2, tp=2))
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard", "tp"]
    with pytest.raises(ValueError, match=r"2 besides shard_dim='dp_cp_shard' have size > 1 \(dp_replicate=2, tp=2\)"):
        parallelize_hsdp(_model(), mesh)


@pytest.mark.distributed(world_size=2)
def test_fsdp_reduces_by_sum_not_mean():
    mesh = _dp_mesh(dp_shard=2)
    model = nn.Linear(2, 2, bias=False)
    parallelize_fsdp(model, mesh["dp_cp_shard"])
    model(torch.ones(1, 2)).sum().backward()  # each rank's gradient is all ones
    assert isinstance(model.weight.grad, DTensor)
    torch.testing.assert_close(model.weight.grad.full_tensor(), torch.full((2, 2), 2.0))
