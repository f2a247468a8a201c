"""The Qwen3 parallel plans on 2 gloo ranks: sharded initialisation and one training step equal single-process.

float32 throughout: the only differences are summation orders (per-rank loss sums, gradient reduction), so 1e-5.
"""

import pytest
import torch
from tiny import DENSE_HF, EAGER, MOE_HF, VOCAB
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.models import materialize_
from d9d.models.blocks.inputs import CausalLMOutput
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.parallel import FsdpConfig, ReplicateConfig

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

FAMILIES = {
    "dense": (Qwen3DenseForCausalLM, parallelize_qwen3_dense, qwen3_dense_parameters_from_hf, DENSE_HF),
    "moe": (Qwen3MoeForCausalLM, parallelize_qwen3_moe, qwen3_moe_parameters_from_hf, MOE_HF),
}


def _build(cls, params):
    with torch.device("meta"):
        return cls(params, config=EAGER)


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@pytest.mark.parametrize("strategy", ["fsdp", "replicate"])
@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=2, timeout=120)
def test_parallel_plan_matches_single_process(family, strategy):
    cls, parallelize, params_from_hf, hf_config = FAMILIES[family]
    params = params_from_hf({**hf_config, "num_hidden_layers": 2})
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2) if strategy == "fsdp" else MeshDegrees(dp_replicate=2))
    model = _build(cls, params)
    sync = parallelize(model, ctx, FsdpConfig() if strategy == "fsdp" else ReplicateConfig())
    torch.manual_seed(7)
    materialize_(model, "cpu")
    reference = _build(cls, params)
    torch.manual_seed(7)
    materialize_(reference, "cpu")
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert torch.equal(_full(param), reference_params[name]), f"initialisation of {name}"
    if strategy == "fsdp":
        assert any(type(m).__name__.startswith("FSDP") for m in model.model.layers.values())

    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (4, 9), generator=generator)
    labels = torch.randint(0, VOCAB, (4, 9), generator=generator)
    labels[1, :4] = -100
    count = (labels != -100).sum()
    rows = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    sync.begin_step(1)
    loss = model(ids[rows], labels=labels[rows]).losses.sum() / count
    loss.backward()
    sync.wait()
    (reference(ids, labels=labels).losses.sum() / count).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param.grad), reference_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)
    # Logits (no labels) go through the head's forward too, so FSDP gathers its weight for them.
    with torch.no_grad():
        torch.testing.assert_close(model(ids[rows]).logits, reference(ids[rows]).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.distributed(world_size=2)
def test_dense_expert_parallel_degrees_are_refused_clearly():
    # Expert parallelism needs experts: a dense model refuses it.
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, ep=2))
    dense = _build(Qwen3DenseForCausalLM, qwen3_dense_parameters_from_hf(DENSE_HF))
    with pytest.raises(NotImplementedError, match="ep=2 is not supported yet"):
        parallelize_qwen3_dense(dense, ctx, FsdpConfig())


def test_model_output_is_a_pytree_so_fsdp_hooks_its_tensors():
    # FSDP2 registers a unit's pre-backward all-gather on the tensors it finds by pytree-flattening the unit's output.
    # torch 2.11 does not look inside unregistered dataclasses: the root unit's parameters then stayed freed during
    # backward and the FSDP Qwen3 tests crashed (SIGSEGV on CPU, illegal memory access on CUDA).
    losses = torch.ones(3, requires_grad=True)
    leaves, _ = tree_flatten(CausalLMOutput(losses=losses))
    assert len(leaves) == 1 and leaves[0] is losses
