"""Full tune, stacking, freezing and the optimizer, and the discriminated config union with its errors."""

import pytest
import torch
from peft_models import ATTENTION, build, tokens
from pydantic import TypeAdapter, ValidationError

from d9d.peft import (
    AnyPeftConfig,
    FullTune,
    LoRA,
    PeftStack,
    build_peft_method,
    inject_peft_and_freeze,
    trainable_parameter_names,
)

CONFIG = TypeAdapter(AnyPeftConfig)
NORMS = r".*layernorm|model\.norm"


def test_config_union_is_resolved_by_kind_and_builds_the_matching_method():
    config = CONFIG.validate_python(
        {
            "kind": "stack",
            "methods": [
                {"kind": "lora", "module_name_pattern": ATTENTION, "params": {"r": 4, "alpha": 8, "rslora": True}},
                {"kind": "full_tune", "module_name_pattern": NORMS},
            ],
        }
    )
    method = build_peft_method(config)
    assert isinstance(method, PeftStack)
    assert [type(inner) for inner in method.methods] == [LoRA, FullTune]
    assert CONFIG.validate_json(CONFIG.dump_json(config)) == config  # the pattern round-trips as its text


def test_config_errors_name_the_field_and_the_value():
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        CONFIG.validate_python({"kind": "prefix_tuning", "module_name_pattern": "x"})
    with pytest.raises(ValidationError, match=r"params\.r"):
        CONFIG.validate_python({"kind": "lora", "module_name_pattern": "x", "params": {"r": 0}})
    with pytest.raises(ValidationError, match=r"rank\n  Extra inputs are not permitted"):
        CONFIG.validate_python({"kind": "lora", "module_name_pattern": "x", "rank": 4})


def test_a_pattern_that_matches_nothing_names_the_pattern_and_shows_module_names():
    method = build_peft_method(CONFIG.validate_python({"kind": "lora", "module_name_pattern": r".*\.qproj"}))
    with pytest.raises(ValueError, match=r"module_name_pattern='\.\*\\\\\.qproj' fully matches no module.*self_attn"):
        build(False, lambda model: inject_peft_and_freeze(method, model))


def test_lora_on_a_module_that_is_not_linear_is_refused_with_its_class():
    method = build_peft_method(CONFIG.validate_python({"kind": "lora", "module_name_pattern": r".*\.self_attn"}))
    with pytest.raises(ValueError, match=r"GroupedQueryAttention; LoRA applies to nn\.Linear and GroupedLinear"):
        build(False, lambda model: inject_peft_and_freeze(method, model))


def test_full_tune_trains_exactly_the_matched_modules_and_adds_nothing():
    method = build_peft_method(CONFIG.validate_python({"kind": "full_tune", "module_name_pattern": NORMS}))
    model = build(False)
    names = set(model.state_dict())
    result = inject_peft_and_freeze(method, model)
    assert set(model.state_dict()) == names and not result.adapter_names
    assert set(trainable_parameter_names(model)) == result.parameters_to_train
    assert result.parameters_to_train == {
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
    }  # fmt: skip


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_only_selected_parameters_change_and_the_optimizer_holds_state_only_for_them(moe):
    config = {
        "kind": "stack",
        "methods": [
            {"kind": "lora", "module_name_pattern": r".*\.(q|v)_proj|.*experts\.down_proj", "params": {"r": 2}},
            {"kind": "full_tune", "module_name_pattern": r"model\.norm"},
        ],
    }
    method = build_peft_method(CONFIG.validate_python(config))
    model = build(moe)
    result = inject_peft_and_freeze(method, model)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.05)
    for step in range(3):
        ids = tokens(seed=step)
        model(ids[:, :-1], labels=ids[:, 1:]).losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}
    assert changed == set(result.parameters_to_train)
    assert any(name.endswith("lora_A") for name in changed) and "model.norm.weight" in changed
    assert {id(param) for param in optimizer.state} == {id(param) for param in trainable}
    assert all(param.grad is None for param in model.parameters() if not param.requires_grad)
