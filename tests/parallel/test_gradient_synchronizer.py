"""The bucketed gradient synchroniser: sums over replicas, overlaps with backward, never mismatches collectives."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.parallel import GradientSynchronizer, parallelize_replicate


def _mesh(**degrees):
    ctx = DistributedContext.build(MeshDegrees(**degrees))
    return ctx.mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard"]


def _stack(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def _rank_inputs(rows=3, dtype=torch.float32):
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    return torch.randn(rows, 4, generator=generator).to(dtype)


def _expected_grads(dtype=torch.float32, world_size=4, rows=3):
    """The sum over ranks of each rank's gradient: what the synchroniser must produce."""
    total = {}
    for rank in range(world_size):
        model = _stack(dtype)
        inputs = torch.randn(rows, 4, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
        model(inputs).float().pow(2).sum().backward()
        for name, param in model.named_parameters():
            total[name] = total.get(name, 0) + param.grad.float()
    return total


@pytest.mark.parametrize("degrees", [{"dp_replicate": 4}, {"dp_replicate": 2, "dp_shard": 2}], ids=["1d", "2x2"])
@pytest.mark.distributed(world_size=4)
def test_gradients_are_summed_over_every_replica_dimension(degrees):
    mesh = _mesh(**degrees)
    model = _stack()
    parallelize_replicate(model, mesh)
    sync = GradientSynchronizer.for_module(model, bucket_size_mb=1e-4)
    assert len(sync.buckets) > 1
    for _ in range(2):  # two steps: the second must start again from zero
        sync.begin_step(1)
        model(_rank_inputs()).pow(2).sum().backward()
        sync.wait()
    expected = _expected_grads()
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor)
        assert param.grad.placements == (Replicate(), Replicate())
        torch.testing.assert_close(param.grad.to_local(), expected[name], msg=name)


@pytest.mark.distributed(world_size=4)
def test_micro_batches_accumulate_in_place_and_reduce_once():
    mesh = _mesh(dp_replicate=4)
    model = _stack()
    parallelize_replicate(model, mesh)
    sync = GradientSynchronizer.for_module(model)
    sync.begin_step(3)
    inputs = _rank_inputs(rows=3)
    for index in range(3):
        model(inputs[index : index + 1]).pow(2).sum().backward()
    sync.wait()
    expected = _expected_grads()
    bucket = sync.buckets[0]
    for (name, param), view in zip(model.named_parameters(), reversed(bucket.views), strict=True):
        assert param.grad.to_local().data_ptr() == view.data_ptr(), "the gradient lives in the bucket"
        torch.testing.assert_close(param.grad.to_local(), expected[name], msg=name)


@pytest.mark.distributed(world_size=2)
def test_buckets_follow_reverse_parameter_order_and_split_by_dtype():
    mesh = _mesh(dp_replicate=2)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4).to(torch.bfloat16), "c": nn.Linear(4, 4)})
    parallelize_replicate(model, mesh)
    sync = GradientSynchronizer.for_module(model, bucket_size_mb=100 * 4 / 2**20)  # 100 float32 values
    layout = [([entry.name for entry in bucket.entries], bucket.key.dtype) for bucket in sync.buckets]
    assert layout == [
        (["c.bias", "c.weight", "a.bias", "a.weight"], torch.float32),
        (["b.bias", "b.weight"], torch.bfloat16),
    ]
    sync = GradientSynchronizer.for_module(model, bucket_size_mb=20 * 4 / 2**20)
    assert [[entry.name for entry in bucket.entries] for bucket in sync.buckets][:2] == [
        ["c.bias", "c.weight"],
        ["b.bias", "b.weight"],
    ]


@pytest.mark.distributed(world_size=4)
def test_bf16_parameters_accumulate_and_reduce_in_fp32_buckets():
    mesh = _mesh(dp_replicate=4)
    model = _stack(torch.bfloat16)
    parallelize_replicate(model, mesh)
    sync = GradientSynchronizer.for_module(model, grad_dtype=torch.float32)
    assert {bucket.key.dtype for bucket in sync.buckets} == {torch.float32}
    sync.begin_step(1)
    model(_rank_inputs(dtype=torch.bfloat16)).float().pow(2).sum().backward()
    sync.wait()
    expected = _expected_grads(torch.bfloat16)  # fp32 sum of each rank's bf16 gradient
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16
        assert param.grad.dtype == torch.float32
        torch.testing.assert_close(param.grad.to_local(), expected[name], rtol=0, atol=0, msg=name)
    sync.remove()
    assert all(param.grad is None and param.grad_dtype == torch.bfloat16 for param in model.parameters())


@pytest.mark.distributed(world_size=2)
def test_a_bucket_is_launched_while_backward_still_runs():
    mesh = _mesh(dp_replicate=2)
    model = _stack()
    parallelize_replicate(model, mesh)
    sync = GradientSynchronizer.for_module(model, bucket_size_mb=1e-5)  # 10 bytes: one bucket per parameter
    seen = []
    first_layer = model[0]
    first_layer.register_full_backward_pre_hook(lambda *_: seen.append([b.launched for b in sync.buckets]))
    sync.begin_step(1)
    model(_rank_inputs()).pow(2).sum().backward()
    sync.wait()
    (launched_when_first_layer_started,) = seen
    # Buckets are in reverse order: the last layers' buckets went out before the first layer's backward began.
    layers = [{entry.name.split(".")[0] for entry in bucket.entries} for bucket in sync.buckets]
    assert len(layers) == 6
    assert launched_when_first_layer_started == [layer != {"0"} for layer in layers]


@pytest.mark.distributed(world_size=4)
def test_parameters_unused_on_some_ranks_do_not_hang_or_mismatch():
    # Rank-dependent control flow: ranks 0 and 1 skip the middle layer in their second micro-batch, so their
    # buckets complete in a different order than on ranks 2 and 3; buckets still go out in one order everywhere.
    mesh = _mesh(dp_replicate=4)
    model = _stack()
    parallelize_replicate(model, mesh)
    sync = GradientSynchronizer.for_module(model, bucket_size_mb=1e-4)
    skip = dist.get_rank() < 2

    def forward(x, use_middle):
        hidden = model[1](model[0](x))
        if use_middle:
            hidden = model[3](model[2](hidden))
        return model[4](hidden)

    sync.begin_step(2)
    forward(_rank_inputs(rows=1), use_middle=True).pow(2).sum().backward()
    forward(_rank_inputs(rows=1), use_middle=not skip).pow(2).sum().backward()
    sync.wait()
    middle = model[2].weight.grad.to_local()
    # Every rank ends with the same (summed) gradient, the unused contributions being zero.
    gathered = [torch.empty_like(middle) for _ in range(4)]
    dist.all_gather(gathered, middle)
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_misuse_fails_with_an_actionable_message():
    mesh = _mesh(dp_replicate=2)
    model = _stack()
    parallelize_replicate(model, mesh)
    sync = GradientSynchronizer.for_module(model)
    with pytest.raises(RuntimeError, match=r"call GradientSynchronizer.begin_step\(num_microbatches\)"):
        model(_rank_inputs()).sum().backward()
    sync.begin_step(1)
    model(_rank_inputs()).sum().backward()
    with pytest.raises(RuntimeError, match="declared 1 micro-batches"):
        model(_rank_inputs()).sum().backward()
    with pytest.raises(ValueError, match="no trainable parameters distributed by parallelize_replicate"):
        GradientSynchronizer.for_module(nn.Linear(2, 2))


@pytest.mark.distributed(world_size=2)
def test_optimizer_zero_grad_between_steps_is_harmless():
    mesh = _mesh(dp_replicate=2)
    model = _stack()
    parallelize_replicate(model, mesh)
    sync = GradientSynchronizer.for_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        sync.begin_step(2)
        optimizer.zero_grad(set_to_none=True)  # replaces the bucket views by None; the hooks take grads back
        inputs = _rank_inputs(rows=2)
        model(inputs[:1]).pow(2).sum().backward()
        model(inputs[1:]).pow(2).sum().backward()
        sync.wait()
        optimizer.step()
    expected = _expected_grads(world_size=2, rows=2)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.to_local(), expected[name], msg=name)
