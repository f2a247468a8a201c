"""`begin_step` of the single-device and FSDP syncs: gradients cleared from a parameter list collected at the first
step, no walk over the module tree per step, and (single device) `grad_dtype` set once and kept by storage moves.

Same tiny Qwen3 dense model as test_single_device.py. Two steps on the same batch without an optimizer step in
between must give bitwise-equal gradients (a missed clear would double them).
"""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.models import materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters, parallelize_qwen3_dense
from d9d.parallel import FsdpConfig, MixedPrecisionConfig, ModuleGradientSync, SingleDeviceConfig

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

PARAMS = Qwen3DenseParameters(
    hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    vocab_size=64,
)  # fmt: skip


def _build(config):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=-1), device="cpu")
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(PARAMS)
    sync = parallelize_qwen3_dense(model, ctx, config)
    torch.manual_seed(0)
    materialize_(model, "cpu")
    walks = []
    walk = model.named_parameters
    model.named_parameters = lambda *args, **kwargs: walks.append(1) or walk(*args, **kwargs)  # a spy
    return ctx, model, sync, walks, walk


def _step_grads(model, sync, named, ids):
    sync.begin_step(1)
    model(ids, labels=torch.roll(ids, -1, dims=1)).losses.sum().backward()
    sync.wait()
    return {name: _local(param.grad).clone() for name, param in named() if param.grad is not None}


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@pytest.mark.distributed(world_size=1, timeout=120)
def test_single_device_sync_sets_grad_dtype_once_and_storage_moves_keep_it():
    ctx, model, sync, walks, named = _build(SingleDeviceConfig(mixed_precision=MixedPrecisionConfig()))
    ids = torch.randint(0, PARAMS.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    first = _step_grads(model, sync, named, ids)
    assert walks == [1]  # the first `begin_step` collected the list
    walks.clear()
    assert {grad.dtype for grad in first.values()} == {torch.float32}  # bf16 parameters, float32 gradients
    # Move every parameter's storage, as checkpoint loading or `cast_parameters_` may: the objects stay, and torch
    # keeps `Tensor.grad_dtype` across `.data` assignment, so nothing needs setting again.
    for _, param in named():
        param.data = param.data.clone()
    second = _step_grads(model, sync, named, ids)
    third = _step_grads(model, sync, named, ids)
    assert walks == []  # later steps only cleared it
    for name, grad in first.items():
        assert second[name].dtype == torch.float32, name
        torch.testing.assert_close(second[name], grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(third[name], grad, rtol=0, atol=0, msg=name)
    ctx.close()


@pytest.mark.distributed(world_size=1, timeout=120)
def test_single_device_sync_refuses_a_first_step_on_the_meta_device():
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(PARAMS)
    sync = parallelize_qwen3_dense(model, ctx, SingleDeviceConfig())
    with pytest.raises(RuntimeError, match=r"still on the meta device at the first training step; materialise"):
        sync.begin_step(1)
    ctx.close()


@pytest.mark.distributed(world_size=2, timeout=180)
def test_fsdp_sync_clears_gradients_each_step_from_a_list_collected_once():
    ctx, model, sync, walks, named = _build(FsdpConfig())
    ids = torch.randint(0, PARAMS.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1 + ctx.rank))
    first = _step_grads(model, sync, named, ids)  # walks: the sync's collection, FSDP's lazy init at first forward
    walks.clear()
    assert all(isinstance(param, DTensor) for _, param in named())
    second = _step_grads(model, sync, named, ids)
    assert walks == []
    for name, grad in first.items():
        torch.testing.assert_close(second[name], grad, rtol=0, atol=0, msg=name)
    ctx.close()


def test_a_parameter_unfrozen_after_the_first_step_is_cleared_too():
    """The list holds every parameter, trainable at the first step or not: the gradients of one unfrozen later
    (a fine-tuning schedule) start each step cleared, as `module.zero_grad` did."""
    module = nn.Linear(3, 2)
    module.bias.requires_grad_(False)
    sync = ModuleGradientSync(module)
    sync.begin_step(1)
    module.bias.requires_grad_(True)
    for _ in range(2):
        sync.begin_step(1)
        module(torch.ones(1, 3)).sum().backward()
    torch.testing.assert_close(module.bias.grad, torch.ones(2))  # one step's gradient, not two
