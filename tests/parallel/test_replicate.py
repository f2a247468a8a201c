"""parallelize_replicate: DTensor parameters outside forward, plain tensors inside, gradients equal to DDP's."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils.checkpoint import checkpoint

from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.parallel import BF16_COMPUTE_FP32_REDUCE, GradientSynchronizer, parallelize_replicate


def _mesh(world=2):
    return DistributedContext.build(MeshDegrees(dp_replicate=world)).mesh_for(MeshDomain.DENSE)["dp_replicate"]


class TiedLM(nn.Module):
    """Embedding and head share one weight; the head reads it through the embedding (not its own forward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, tokens, recompute=False):
        hidden = self.embed(tokens)
        hidden = checkpoint(self.block, hidden, use_reentrant=False) if recompute else self.block(hidden)
        return (hidden * self.scale) @ self.embed.weight.T


def _tokens(rank):
    return torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank))


def _reference_grads(world, recompute=False):
    model = TiedLM()
    for rank in range(world):
        model(_tokens(rank), recompute=recompute).pow(2).mean().backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "activation-checkpointing"])
@pytest.mark.distributed(world_size=2)
def test_tied_weights_and_recomputation_give_the_summed_single_process_gradient(recompute):
    model = TiedLM()
    handle = parallelize_replicate(model, _mesh())
    assert len(handle.parameters) == 6  # the tied weight once
    sync = GradientSynchronizer.for_module(model)
    sync.begin_step(1)
    model(_tokens(dist.get_rank()), recompute=recompute).pow(2).mean().backward()
    sync.wait()
    expected = _reference_grads(2, recompute)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.to_local(), expected[name], msg=name)


@pytest.mark.distributed(world_size=2)
def test_parameters_are_dtensors_outside_forward_and_plain_inside():
    model = TiedLM()
    parallelize_replicate(model, _mesh())
    seen = {}

    def look(module, args):
        seen["weight"] = type(module.weight)
        seen["embed_weight"] = type(model.embed.weight)  # another module's parameter, read from inside a forward

    model.block[0].register_forward_pre_hook(look)
    model(_tokens(0))
    assert seen == {"weight": torch.Tensor, "embed_weight": torch.Tensor}
    assert type(model.block[0]) is nn.Linear, "the generated class is gone after forward"
    assert isinstance(model.block[0].weight, DTensor)
    assert model.block[0].weight.placements == (Replicate(),)
    assert all(isinstance(value, DTensor) for value in model.state_dict().values())


@pytest.mark.distributed(world_size=2)
def test_a_failing_forward_leaves_the_module_as_it_was():
    model = TiedLM()
    parallelize_replicate(model, _mesh())
    with pytest.raises(IndexError):
        model(torch.tensor([[99]]))  # out of the embedding's range
    assert type(model.embed) is nn.Embedding and isinstance(model.embed.weight, DTensor)
    model(_tokens(0))  # and the next forward works


@pytest.mark.distributed(world_size=2)
def test_mixed_precision_computes_in_bf16_and_returns_fp32_gradients():
    model = TiedLM()
    parallelize_replicate(model, _mesh(), mixed_precision=BF16_COMPUTE_FP32_REDUCE)
    dtypes = []
    model.block[0].register_forward_pre_hook(lambda module, args: dtypes.append((module.weight.dtype, args[0].dtype)))
    sync = GradientSynchronizer.for_module(model)
    sync.begin_step(1)
    output = model(_tokens(0))
    output.float().sum().backward()
    sync.wait()
    assert output.dtype == torch.bfloat16
    assert dtypes == [(torch.bfloat16, torch.bfloat16)]
    assert {param.dtype for param in model.parameters()} == {torch.float32}
    assert {param.grad.dtype for param in model.parameters()} == {torch.float32}


@pytest.mark.distributed(world_size=2)
def test_gradients_are_partial_until_synchronised():
    model = TiedLM()
    parallelize_replicate(model, _mesh())
    model(_tokens(dist.get_rank())).sum().backward()
    assert {param.grad.placements for param in model.parameters()} == {(Partial(),)}


@pytest.mark.distributed(world_size=2)
def test_replicas_start_identical_even_from_different_initialisations():
    torch.manual_seed(dist.get_rank())
    model = nn.Linear(3, 3)
    parallelize_replicate(model, _mesh())
    gathered = [torch.empty(3, 3) for _ in range(2)]
    dist.all_gather(gathered, model.weight.to_local())
    torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_a_meta_model_is_replicated_then_materialised():
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    parallelize_replicate(model, _mesh())
    assert model.weight.is_meta and isinstance(model.weight, DTensor)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    model.reset_parameters()
    assert isinstance(model.weight, DTensor) and not model.weight.is_meta
    model(torch.ones(2, 4)).sum().backward()
    assert model.weight.grad.placements == (Partial(),)


@pytest.mark.distributed(world_size=2)
def test_replicating_twice_names_the_parameter():
    model = nn.Sequential(nn.Linear(2, 2))
    parallelize_replicate(model, _mesh())
    with pytest.raises(ValueError, match=r"parameter '0.weight' is already a DTensor"):
        parallelize_replicate(model, _mesh())


@pytest.mark.distributed(world_size=2)
def test_replicate_config_on_a_meta_model_allocates_buckets_at_the_first_step():
    from d9d.parallel import DeferredGradientSynchronizer, ReplicateConfig, build_data_parallel

    with torch.device("meta"):
        model = nn.Linear(4, 3)
    sync = build_data_parallel(ReplicateConfig(), model, _mesh())
    assert isinstance(sync, DeferredGradientSynchronizer) and sync.synchronizer is None
    with pytest.raises(RuntimeError, match=r"still on the meta device at the first training step"):
        sync.begin_step(1)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    model.reset_parameters()
    sync.begin_step(1)
    rank = dist.get_rank()
    model(torch.full((2, 4), float(rank + 1))).sum().backward()
    sync.wait()
    buffers = {bucket.buffer.device.type for bucket in sync.synchronizer.buckets}
    assert buffers == {"cpu"}
    # the synchronised gradient is the sum over both ranks' inputs (1s and 2s): 2*(1+2) per weight element
    torch.testing.assert_close(model.weight.grad.full_tensor(), torch.full((3, 4), 6.0))
