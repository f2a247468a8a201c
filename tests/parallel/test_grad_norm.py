"""The gradient norm is exact on FSDP, 2x2 HSDP and mixed hybrid meshes: every element counted exactly once."""

import math

import pytest
import torch
import torch.distributed as dist
from dp_workloads import GLOBAL_BATCH, UNITS, loss_sum, make_batches, make_model
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.parallel import (
    GradientSynchronizer,
    clip_grad_norm_,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
    total_grad_norm,
)

NORM_TYPES = [2.0, 1.0, 3.0, math.inf]


def _reference_grads(kind):
    model = make_model(kind)
    batch = make_batches(steps=1)[0]
    (loss_sum(model(batch.inputs), batch) / batch.tokens).backward()
    return model


def _sharded_grads(kind, degrees, shard):
    ctx = DistributedContext.build(degrees)
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard"]
    model = make_model(kind)
    for name in UNITS[kind]:
        shard(model.get_submodule(name), mesh)
    shard(model, mesh)
    batch = make_batches(steps=1)[0]
    dp_rank, dp_size = ctx.coordinate(MeshDomain.BATCH)["dp"], ctx.degrees.dp
    local = GLOBAL_BATCH // dp_size
    shard_batch = batch.rows(dp_rank * local, (dp_rank + 1) * local)
    (loss_sum(model(shard_batch.inputs), shard_batch) / batch.tokens).backward()
    return model


SETUPS = {
    "fsdp": (MeshDegrees(dp_shard=4), lambda module, mesh: parallelize_fsdp(module, mesh["dp_cp_shard"])),
    "hsdp-2x2": (MeshDegrees(dp_replicate=2, dp_shard=2), lambda module, mesh: parallelize_hsdp(module, mesh)),
}


@pytest.mark.parametrize("setup", ["fsdp", "hsdp-2x2"])
@pytest.mark.parametrize("kind", ["mlp", "block"])
@pytest.mark.distributed(world_size=4)
def test_norm_and_clipped_gradients_equal_single_process(kind, setup):
    degrees, shard = SETUPS[setup]
    reference = _reference_grads(kind)
    model = _sharded_grads(kind, degrees, shard)
    placements = {param.placements for param in model.parameters()}
    assert placements == ({(Shard(0),)} if setup == "fsdp" else {(Replicate(), Shard(0))})
    for norm_type in NORM_TYPES:
        expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type)
        actual = total_grad_norm(model.parameters(), norm_type)
        assert actual.item() == pytest.approx(expected.item(), rel=1e-6), norm_type

    max_norm = 0.25 * torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    norm = clip_grad_norm_(model.parameters(), max_norm)
    assert norm.item() == pytest.approx(expected_norm.item(), rel=1e-6)
    clipped = {name: param.grad.full_tensor() for name, param in model.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(clipped[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert total_grad_norm(model.parameters()).item() == pytest.approx(max_norm, rel=1e-5)


class _TwoParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.sharded = nn.Linear(8, 6)
        self.replicated = nn.Linear(6, 3)

    def forward(self, x):
        return self.replicated(torch.tanh(self.sharded(x)))


@pytest.mark.distributed(world_size=4)
def test_replicated_parameters_are_counted_once_beside_sharded_ones():
    # One model on the 2x2 mesh: HSDP parameters (Replicate, Shard) beside fully replicated ones (Replicate,
    # Replicate), and a plain tensor, so the norm combines three placement groups.
    ctx = DistributedContext.build(MeshDegrees(dp_replicate=2, dp_shard=2))
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard"]
    torch.manual_seed(0)
    reference = _TwoParts()
    extra_reference = torch.randn(5, requires_grad=True)
    inputs = torch.randn(8, 8)
    (reference(inputs).pow(2).sum() + extra_reference.sum() * 0.5).backward()

    model = _TwoParts()
    model.load_state_dict(reference.state_dict())
    extra = extra_reference.detach().clone().requires_grad_()
    parallelize_hsdp(model.sharded, mesh)
    parallelize_replicate(model.replicated, mesh)
    sync = GradientSynchronizer.for_module(model.replicated)
    sync.begin_step(1)
    rank = dist.get_rank()
    (model(inputs[2 * rank : 2 * rank + 2]).pow(2).sum() + extra.sum() * 0.5 / 4).backward()
    sync.wait()
    dist.all_reduce(extra.grad)  # a plain (non-DTensor) parameter, synchronised by hand: counted as-is
    parameters = [*model.parameters(), extra]
    assert {p.placements for p in model.replicated.parameters()} == {(Replicate(), Replicate())}
    for norm_type in NORM_TYPES:
        expected = torch.nn.utils.get_total_norm(
            [p.grad for p in reference.parameters()] + [extra_reference.grad], norm_type
        )
        assert total_grad_norm(parameters, norm_type).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.distributed(world_size=2)
def test_an_unsynchronised_partial_gradient_is_refused():
    mesh = DistributedContext.build(MeshDegrees(dp_replicate=2)).mesh_for(MeshDomain.DENSE)["dp_replicate"]
    param = nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
    param.grad = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    with pytest.raises(ValueError, match="Partial gradient is not synchronised"):
        total_grad_norm([param])


@pytest.mark.distributed(world_size=4)
def test_norm_sums_over_pipeline_stages_passed_as_across():
    # Two "stages" of two ranks each own different parameters; `across` joins them.
    ctx = DistributedContext.build(MeshDegrees(pp=2, dp_shard=2))
    dense = ctx.mesh_for(MeshDomain.DENSE)
    stage = ctx.pp_rank
    full = torch.arange(1.0, 7.0) * (stage + 1)
    param = nn.Parameter(distribute_tensor(full, dense["dp_cp_shard"], [Shard(0)]))
    param.grad = distribute_tensor(full, dense["dp_cp_shard"], [Shard(0)])
    across = dense.get_group("pp")
    expected = torch.cat([torch.arange(1.0, 7.0), 2 * torch.arange(1.0, 7.0)]).norm()
    assert total_grad_norm([param], across=across).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.distributed(world_size=4, timeout=120)
def test_norm_counts_expert_parallel_params_fsdp_sharded_again_once():
    # Experts Shard(0) over ep=2, then FSDP over ep_replicate=2: FSDP2 labels the first dimension `_StridedShard`,
    # which recent PyTorch does not derive from `Shard`; the norm must still reduce over both dimensions.
    from d9d.parallel import shard_experts

    ctx = DistributedContext.build(MeshDegrees(dp_shard=4, ep=2))
    experts = nn.Module()
    experts.weight = nn.Parameter(torch.arange(8 * 3 * 2, dtype=torch.float32).view(8, 3, 2) / 10)
    full = experts.weight.detach().clone()
    shard_experts(experts, ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep"], num_experts=8)
    assert isinstance(experts.weight, DTensor)
    experts.weight.grad = experts.weight.detach().clone()
    for norm_type in NORM_TYPES:
        expected = torch.linalg.vector_norm(full, norm_type)
        torch.testing.assert_close(total_grad_norm([experts.weight], norm_type), expected, rtol=1e-6, atol=0)


class _CountNormKernels(TorchDispatchMode):
    """Counts the norm ops that reach ATen (a mode sees the top-level calls, not the ops a kernel calls inside)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "norm" in name:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _mixed_gradients():
    """50 float32 and 30 bfloat16 gradients of different sizes, and an empty one (an FSDP rank's padding shard)."""
    generator = torch.Generator().manual_seed(3)
    params = []
    for index in range(81):
        dtype = torch.bfloat16 if index % 8 in (1, 4, 6) and index != 80 else torch.float32
        size = 0 if index == 80 else 1 + (index * 37) % 300
        param = nn.Parameter(torch.zeros(size, dtype=dtype))
        param.grad = (torch.randn(size, generator=generator) * (1 + index % 5)).to(dtype)
        params.append(param)
    assert {p.grad.dtype for p in params} == {torch.float32, torch.bfloat16}
    return params


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_norm_takes_one_foreach_norm_per_dtype_with_the_per_tensor_result(norm_type):
    params = _mixed_gradients()
    with _CountNormKernels() as counted:
        norm = total_grad_norm(params, norm_type)
    assert counted.calls == {"_foreach_norm": 2}, counted.calls  # one per dtype, no per-parameter reduction
    assert norm.dtype == torch.float32
    # The per-tensor float32 norms this replaces (float32 accumulation of bf16 values too): same value up to the
    # order of float32 summation.
    nonempty = [p.grad for p in params if p.grad.numel() > 0]
    per_tensor = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in nonempty])
    expected = per_tensor.max() if math.isinf(norm_type) else per_tensor.pow(norm_type).sum().pow(1 / norm_type)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    # Against the exact norm (float64 over the same bf16/fp32 values): float32 accumulation keeps ~1e-7 relative
    # error; a bf16 accumulation would be off by ~1e-3.
    exact = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]), norm_type)
    torch.testing.assert_close(norm.double(), exact, rtol=1e-6, atol=0)


def test_clip_scales_every_dtype_group_by_the_same_coefficient():
    params = _mixed_gradients()
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, max_norm=1.0)
    coefficient = 1.0 / (norm.item() + 1e-6)
    for param, grad in zip(params, before, strict=True):
        torch.testing.assert_close(param.grad, (grad.float() * coefficient).to(grad.dtype))
    assert total_grad_norm(params).item() == pytest.approx(1.0, rel=1e-2)  # bf16 rounding of the scaled values
