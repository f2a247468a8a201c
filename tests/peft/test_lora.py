"""LoRA on linear layers and grouped experts: exact identity when fresh, merge parity after training, init and
merge semantics of the modules themselves."""

import pytest
import torch
from peft_models import ATTENTION, DENSE, EAGER, EXPERTS, build, logits, tokens
from torch import nn

from d9d.kernels.grouped_mm import EagerGroupedMm
from d9d.models.blocks.moe import GroupedLinear
from d9d.models.qwen3 import Qwen3DenseForCausalLM
from d9d.models.roles import Role, with_role
from d9d.parallel import roles_of
from d9d.peft import (
    LoRAConfig,
    LoRAGroupedLinear,
    LoRALinear,
    LoRAParameters,
    PeftStackConfig,
    adapter_state_names,
    build_peft_method,
    inject_peft_and_freeze,
    merge_peft,
)

BOTH = rf"{ATTENTION}|{EXPERTS}"


def lora(pattern: str, **params) -> LoRAConfig:
    return LoRAConfig(module_name_pattern=pattern, params=LoRAParameters(**params))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fresh_injection_on_meta_gives_exactly_the_base_model(moe):
    method = build_peft_method(lora(BOTH if moe else ATTENTION, r=4, alpha=8))
    base = build(moe)
    injected = build(moe, lambda model: inject_peft_and_freeze(method, model))
    base_state = base.state_dict()
    for name, value in injected.state_dict().items():
        if name.endswith(("lora_A", "lora_B")):
            continue
        assert torch.equal(value, base_state[name]), name  # adapters are initialised after every base weight
    ids = tokens()
    torch.testing.assert_close(logits(injected, ids), logits(base, ids), rtol=0, atol=0)  # B = 0: bitwise equal


def test_adapters_initialise_b_to_zero_and_a_uniform_through_materialize():
    method = build_peft_method(lora(ATTENTION, r=4))
    model = build(False, lambda model: inject_peft_and_freeze(method, model))
    q_proj = model.model.layers["0"].self_attn.q_proj
    assert isinstance(q_proj, LoRALinear)
    assert torch.count_nonzero(q_proj.lora_B) == 0
    bound = q_proj.in_features**-0.5
    assert q_proj.lora_A.abs().max() <= bound and q_proj.lora_A.std() > bound / 4  # U(-1/sqrt(in), 1/sqrt(in))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_injection_into_a_materialised_model_reuses_its_weights(moe):
    model = build(moe)
    before = logits(model, tokens())
    weight = model.model.layers["0"].self_attn.q_proj.weight
    inject_peft_and_freeze(build_peft_method(lora(BOTH if moe else ATTENTION)), model)
    assert model.model.layers["0"].self_attn.q_proj.weight is weight
    torch.testing.assert_close(logits(model, tokens()), before, rtol=0, atol=0)


def _train_adapters(model: nn.Module, steps: int = 3) -> None:
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    for step in range(steps):
        ids = tokens(seed=10 + step)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).losses.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize(
    ("moe", "dtype", "tolerance"),
    [
        (False, torch.float32, 2e-5),  # one fp32 rounding of W + sBA against two separate fp32 matmuls
        (True, torch.float32, 2e-5),
        # bf16 has 8 mantissa bits: the merged weight is rounded once more than the unmerged sum (rel. 2^-8 per
        # element, summed over layers), so compare with a bf16-sized tolerance.
        (False, torch.bfloat16, 6e-2),
    ],
    ids=["dense-fp32", "moe-fp32", "dense-bf16"],
)
def test_merged_weights_give_the_outputs_of_the_unmerged_adapters(moe, dtype, tolerance):
    method = build_peft_method(lora(BOTH if moe else ATTENTION, r=4, alpha=16, dropout=0.1))
    model = build(moe, lambda model: inject_peft_and_freeze(method, model))
    _train_adapters(model)
    model.to(dtype).eval()
    ids = tokens(seed=99)
    with torch.no_grad():
        unmerged = logits(model, ids).float()
        merge_peft(method, model)
        merged = logits(model, ids).float()
    assert all(sub.merged for sub in model.modules() if isinstance(sub, LoRALinear | LoRAGroupedLinear))
    assert not torch.allclose(unmerged, logits(build(moe).to(dtype), ids).float(), atol=1e-3)  # adapters trained
    torch.testing.assert_close(merged, unmerged, rtol=tolerance, atol=tolerance)


def test_grouped_adapter_matches_a_per_expert_reference():
    torch.manual_seed(0)
    base = GroupedLinear(3, 8, 5, backend=EagerGroupedMm())
    nn.init.normal_(base.weight)
    layer = LoRAGroupedLinear(base, LoRAParameters(r=2, alpha=3, rslora=True))
    nn.init.normal_(layer.lora_B)
    x, sizes = torch.randn(7, 8), torch.tensor([3, 0, 4])
    expected = []
    for rows, weight, a, b in zip(x.split(sizes.tolist()), base.weight, layer.lora_A, layer.lora_B, strict=True):
        expected.append(rows @ weight.T + (rows @ a.T @ b.T) * (3 / 2**0.5))  # rsLoRA: alpha / sqrt(r)
    torch.testing.assert_close(layer(x, sizes), torch.cat(expected))


def test_rslora_and_plain_scaling():
    assert LoRAParameters(r=4, alpha=8).scaling == 2.0
    assert LoRAParameters(r=4, alpha=8, rslora=True).scaling == 4.0


def test_adapter_names_and_the_load_mapper_keep_base_names():
    method = build_peft_method(lora(ATTENTION, r=2))
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(DENSE, config=EAGER)
    base_names = set(model.state_dict())
    result = inject_peft_and_freeze(method, model)
    assert result.adapter_names == adapter_state_names(model)
    assert len(result.adapter_names) == 2 * 4 * 2  # A and B, 4 projections, 2 layers
    assert set(model.state_dict()) == base_names | result.adapter_names
    groups = result.load_state_mapper.state_dependency_groups()
    assert {name for group in groups for name in group.outputs} == base_names


def test_a_second_lora_on_the_same_module_is_refused():
    method = build_peft_method(PeftStackConfig(methods=[lora(ATTENTION), lora(r".*q_proj")]))
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        build(False, lambda model: inject_peft_and_freeze(method, model))


def test_a_wrapped_module_keeps_the_roles_parallel_plans_find_it_by():
    method = build_peft_method(lora(EXPERTS))
    model = build(True)
    experts = model.model.layers["0"].mlp.experts
    with_role(experts.gate_proj, Role.EXPERTS)  # a role on the very module LoRA wraps
    inject_peft_and_freeze(method, model)
    assert isinstance(experts.gate_proj, LoRAGroupedLinear)
    assert str(Role.EXPERTS) in roles_of(experts.gate_proj)
