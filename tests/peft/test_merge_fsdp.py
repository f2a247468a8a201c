"""Merging LoRA into FSDP-sharded weights after a forward with `reshard_after_forward=False`: that forward leaves
FSDP's temporary unsharded copies in place of the weights, and the merge must still land in the sharded weights
that `state_dict` saves (the `merged/` export). Reference: the same model in one process, W + s * B @ A by hand."""

import pytest
import torch
import torch.distributed as dist
from peft_models import DENSE, EAGER, EXPERTS, MOE, tokens
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.core.determinism import seed_everything
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.models import materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3MoeForCausalLM, parallelize_qwen3_dense, parallelize_qwen3_moe
from d9d.parallel import FsdpConfig
from d9d.peft import (
    LoRAConfig,
    LoRAGroupedLinear,
    LoRALinear,
    LoRAParameters,
    build_peft_method,
    inject_peft_and_freeze,
    merge_peft,
)
from d9d.peft.lora.merge import add_full_

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

SEED = 3


def _config(moe: bool) -> LoRAConfig:
    pattern = rf".*\.self_attn\.(q|v)_proj|{EXPERTS}" if moe else r".*\.self_attn\.(q|v)_proj"
    return LoRAConfig(module_name_pattern=pattern, params=LoRAParameters(r=4, alpha=8))


def _injected_meta_model(moe: bool) -> nn.Module:
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(MOE, config=EAGER) if moe else Qwen3DenseForCausalLM(DENSE, config=EAGER)
    inject_peft_and_freeze(build_peft_method(_config(moe)), model)
    return model


def _set_lora_b(model: nn.Module) -> None:
    """B = 0 after init (the merge would add nothing): give every B the same seeded values on both sides."""
    with torch.no_grad():
        for index, (name, param) in enumerate(sorted(model.named_parameters())):
            if name.endswith("lora_B"):
                value = torch.randn(param.shape, generator=torch.Generator().manual_seed(index)) * 0.5
                if isinstance(param, DTensor):
                    param.to_local().copy_(distribute_tensor(value, param.device_mesh, param.placements).to_local())
                else:
                    param.copy_(value)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in model.state_dict().items()
    }


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.distributed(world_size=2, timeout=120)
def test_merge_after_a_forward_without_reshard_lands_in_the_saved_sharded_weights(moe):
    reference = _injected_meta_model(moe)
    seed_everything(SEED)
    materialize_(reference, "cpu")
    _set_lora_b(reference)
    expected = _full_state(reference)
    for name, sub in reference.named_modules():
        if isinstance(sub, LoRALinear | LoRAGroupedLinear):  # (E, out, r) @ (E, r, in) per expert for experts
            expected[f"{name}.weight"] += (sub.lora_B @ sub.lora_A).detach() * sub.scaling

    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    model = _injected_meta_model(moe)
    parallelize = parallelize_qwen3_moe if moe else parallelize_qwen3_dense
    parallelize(model, ctx, FsdpConfig(reshard_after_forward=False))
    seed_everything(SEED)
    materialize_(model, "cpu")
    _set_lora_b(model)
    method = build_peft_method(_config(moe))
    with torch.no_grad():
        model.eval()(tokens())
        q_proj = model.model.layers["0"].self_attn.q_proj
        assert not isinstance(q_proj.weight, DTensor)  # FSDP's unsharded copy, as the merge would otherwise see it
        with pytest.raises(RuntimeError, match=r"unsharded copy .* reshard"):
            add_full_(q_proj.weight, q_proj.delta_weight(), fsdp_managed=True)
        merge_peft(method, model)
    merged = _full_state(model)
    assert merged.keys() == expected.keys()
    changed = 0
    for name, value in expected.items():
        # fp32 on both sides; B @ A is the same product of the same full tensors, one rounding of W + sBA each.
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6, msg=name)
        changed += not torch.equal(value, _full_state(reference)[name])
    assert changed == (10 if moe else 4)  # q_proj, v_proj (and 3 expert weights) of 2 layers really moved
    dist.barrier()
