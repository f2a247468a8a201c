"""Tensor-parallel styles and the vocabulary-parallel loss on 2 gloo ranks, against the plain computation.

float32; the only differences are summation orders (a split matmul summed over ranks, a log-sum-exp merged from two
halves), so 1e-5 (measured: about 1e-7).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn import functional

from d9d.models.blocks.loss import chunked_linear_cross_entropy
from d9d.parallel.tensor import (
    REPLICATED,
    TensorParallelConfig,
    enable_async_tp,
    parallelize_column,
    parallelize_local_region,
    parallelize_replicated,
    parallelize_row,
    parallelize_vocab_embedding,
    prepare_region_input,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_sum,
    vocab_parallel_logits,
)

TOLERANCE = 1e-5


@pytest.mark.parametrize("chunk_size", [3, 2048])
@pytest.mark.distributed(world_size=2, timeout=120)
def test_vocab_parallel_loss_equals_full_cross_entropy(chunk_size):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    labels = torch.randint(0, 10, (2, 5))
    labels[0, 1] = labels[1, 4] = -100
    # labels owned by each rank's half of the vocabulary appear in the batch
    labels[0, 0], labels[0, 2] = 1, 9

    expected = functional.cross_entropy(hidden.reshape(-1, 8) @ weight.T, labels.reshape(-1), reduction="none")
    expected.sum().backward()

    sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
    local_hidden = hidden.detach().clone().requires_grad_()
    losses = vocab_parallel_cross_entropy(local_hidden, sharded, labels, chunk_size=chunk_size)
    torch.testing.assert_close(losses.reshape(-1), expected, atol=TOLERANCE, rtol=TOLERANCE)
    assert float(losses[0, 1]) == 0.0
    losses.sum().backward()
    torch.testing.assert_close(sharded.grad.full_tensor(), weight.grad, atol=TOLERANCE, rtol=TOLERANCE)
    # the hidden-state gradient of a plain (replicated) input is the all-reduced sum of the ranks' parts
    torch.testing.assert_close(local_hidden.grad, hidden.grad, atol=TOLERANCE, rtol=TOLERANCE)
    # and the chunked loss of d9d.models agrees as well
    torch.testing.assert_close(
        chunked_linear_cross_entropy(hidden.detach(), weight.detach(), labels, chunk_size=chunk_size),
        losses.detach(),
        atol=TOLERANCE,
        rtol=TOLERANCE,
    )
    logits = vocab_parallel_logits(hidden.detach(), sharded.detach())
    torch.testing.assert_close(logits, hidden.detach() @ weight.detach().T, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("chunk_size", [3, 2048])
@pytest.mark.distributed(world_size=2, timeout=120)
def test_vocab_parallel_loss_sum_with_gradients_in_forward_equals_full_cross_entropy(chunk_size):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    labels = torch.randint(0, 10, (2, 5))
    labels[0, 1] = labels[1, 4] = -100
    labels[0, 0], labels[0, 2] = 1, 9  # labels owned by each rank's half of the vocabulary

    expected = functional.cross_entropy(hidden.reshape(-1, 8) @ weight.T, labels.reshape(-1), reduction="none")
    (expected.sum() * 0.3).backward()

    sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
    local_hidden = hidden.detach().clone().requires_grad_()
    total, losses = vocab_parallel_cross_entropy_sum(local_hidden, sharded, labels, chunk_size=chunk_size)
    assert not losses.requires_grad and losses.shape == labels.shape
    torch.testing.assert_close(losses.reshape(-1), expected.detach(), atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(total, expected.sum().detach(), atol=TOLERANCE, rtol=TOLERANCE)
    (total * 0.3).backward()  # scales the gradients formed in forward
    torch.testing.assert_close(sharded.grad.full_tensor(), weight.grad, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(local_hidden.grad, hidden.grad, atol=TOLERANCE, rtol=TOLERANCE)


class _Adapted(nn.Module):
    """A linear wrapper with LoRA-style extra parameters: the styles must split it by parameter name."""

    def __init__(self, in_features: int, out_features: int, rank: int = 2) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.lora_A = nn.Parameter(torch.randn(rank, in_features))
        self.lora_B = nn.Parameter(torch.randn(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, self.weight) + functional.linear(functional.linear(x, self.lora_A), self.lora_B)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = _Adapted(8, 6)
        self.down = _Adapted(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.distributed(world_size=2, timeout=120)
def test_column_then_row_with_adapters_equals_the_plain_module():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = _Mlp()
    model = _Mlp()
    model.load_state_dict(reference.state_dict())
    prepare_region_input(model, mesh)
    parallelize_column(model.up, mesh)
    parallelize_row(model.down, mesh)
    assert model.up.weight.placements == (Shard(0),) and model.up.lora_B.placements == (Shard(0),)
    assert model.up.lora_A.placements[0].is_replicate()
    assert model.down.weight.placements == (Shard(1),) and model.down.lora_A.placements == (Shard(1),)
    assert model.down.lora_B.placements[0].is_replicate()

    x = torch.randn(2, 4, 8)  # sequence 4 over 2 ranks
    expected = reference(x)
    expected.square().sum().backward()
    rank = dist.get_rank()
    x_local = x[:, 2 * rank : 2 * rank + 2].clone().requires_grad_()
    out = model(DTensor.from_local(x_local, mesh, [Shard(1)]))
    assert out.placements == (Shard(1),)  # sequence parallel between regions
    torch.testing.assert_close(out.full_tensor(), expected, atol=TOLERANCE, rtol=TOLERANCE)
    out.to_local().square().sum().backward()
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        # full_tensor gathers a split gradient and sums a Partial one (a replicated parameter's parts over ranks)
        torch.testing.assert_close(
            param.grad.full_tensor(), reference_params[name].grad, atol=TOLERANCE, rtol=TOLERANCE, msg=name
        )


@pytest.mark.distributed(world_size=2, timeout=60)
def test_async_tp_is_refused_on_cpu():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="async_tp=True needs CUDA"):
        enable_async_tp(mesh)


class _Block(nn.Module):
    """Embedding, a norm, a tensor-parallel MLP and a block left whole (like an MoE block), with residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.RMSNorm(8)
        self.mlp = _Mlp()
        self.local = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        hidden = hidden + self.mlp(self.norm(hidden))
        return hidden + self.local(hidden)


@pytest.mark.parametrize("seq", [1, 3])
@pytest.mark.distributed(world_size=2, timeout=120)
def test_replicated_activation_layout_runs_any_sequence_length_like_the_plain_module(seq):
    """Without sequence parallelism (inference): one token or an odd length, activations whole on every rank."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = _Block()
    model = _Block()
    model.load_state_dict(reference.state_dict())
    parallelize_vocab_embedding(model.embed, mesh, output=REPLICATED)
    parallelize_replicated(model.norm, mesh)
    prepare_region_input(model.mlp, mesh)
    parallelize_column(model.mlp.up, mesh)
    parallelize_row(model.mlp.down, mesh, output=REPLICATED)
    parallelize_local_region(model.local, mesh, placement=REPLICATED)
    ids = torch.tensor([[3, 9, 0][:seq], [1, 1, 7][:seq]])
    with torch.no_grad():
        out = model(ids)
        expected = reference(ids)
    assert isinstance(out, DTensor) and out.placements == (REPLICATED,) and out.to_local().shape == (2, seq, 8)
    torch.testing.assert_close(out.to_local(), expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_async_tp_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="async_tp=True needs sequence_parallel=True"):
        TensorParallelConfig(async_tp=True, sequence_parallel=False)
    assert TensorParallelConfig().sequence_parallel  # training's layout stays the default
