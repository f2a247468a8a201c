"""The HF `peft` round trip: our LoRA adapters exported as `adapter_model.safetensors` + `adapter_config.json`,
loaded with `PeftModel.from_pretrained` onto the HF model that holds our base weights, give our logits."""

import json

import pytest
import torch
from peft_models import ATTENTION, DENSE, MOE, build, tokens
from safetensors.torch import load_file

from d9d.models.qwen3 import (
    hf_config_from_qwen3_dense,
    hf_config_from_qwen3_moe,
    mapper_to_huggingface_qwen3_dense,
    mapper_to_huggingface_qwen3_moe,
)
from d9d.peft import LoRAConfig, LoRAParameters, build_peft_method, inject_peft_and_freeze
from d9d.peft.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_hf_peft_adapter
from d9d.states.mapper import Chunk, ModelStateMapper

# transformers' own deprecation inside PeftModel.from_pretrained, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def map_tensors(mapper: ModelStateMapper, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for group in mapper.state_dependency_groups():
        out.update(mapper.apply({name: tensors[name] for name in group.inputs}))
    return out


def _trained_like(pattern: str, *, moe: bool, params: LoRAParameters):
    """A model whose adapters are non-zero (as after training), so the comparison tests the adapter path."""
    method = build_peft_method(LoRAConfig(module_name_pattern=pattern, params=params))
    result = {}
    model = build(moe, lambda model: result.update(injection=inject_peft_and_freeze(method, model)))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.2)
    return model.eval(), result["injection"]


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_peft_from_pretrained_on_the_hf_model_gives_our_logits(tmp_path, rslora):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from peft import PeftModel

    params = LoRAParameters(r=4, alpha=12, dropout=0.05, rslora=rslora)
    model, injection = _trained_like(rf"{ATTENTION}|.*mlp\.(gate|down)_proj", moe=False, params=params)
    to_hf = mapper_to_huggingface_qwen3_dense(DENSE)
    base = {name: value for name, value in model.state_dict().items() if name not in injection.adapter_names}
    hf = Qwen3ForCausalLM(Qwen3Config(**hf_config_from_qwen3_dense(DENSE, dtype=torch.float32))).eval()
    hf.load_state_dict(map_tensors(to_hf, base), strict=True)

    export_hf_peft_adapter(model, to_hf, tmp_path / "adapter", base_model_name_or_path="tiny-qwen3")
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 12 and config["use_rslora"] is rslora
    assert "model.layers.1.mlp.down_proj" in config["target_modules"] and len(config["target_modules"]) == 12
    ids = tokens(rows=2, seq=10)
    with torch.no_grad():
        plain = hf(input_ids=ids).logits  # before peft wraps it (in place): the base model alone
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours = model(ids).logits
        theirs = peft_model(input_ids=ids).logits
    # fp32 on both sides, the same math in another order (HF attention, peft's adapter path): a few ulps per layer.
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    with torch.no_grad(), peft_model.disable_adapter():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, plain)
    assert (theirs - plain).abs().max() > 1e-2  # the adapters matter, so the comparison above tests them


def test_expert_adapters_are_exported_per_expert_in_the_hf_checkpoint_layout(tmp_path):
    params = LoRAParameters(r=2, alpha=4)
    model, _ = _trained_like(r".*\.q_proj|.*experts\.(gate|up|down)_proj", moe=True, params=params)
    export_hf_peft_adapter(model, mapper_to_huggingface_qwen3_moe(MOE), tmp_path)
    tensors = load_file(tmp_path / ADAPTER_WEIGHTS)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    experts = model.model.layers["0"].mlp.experts
    for expert in range(MOE.num_experts):
        prefix = f"base_model.model.model.layers.0.mlp.experts.{expert}"
        torch.testing.assert_close(tensors[f"{prefix}.gate_proj.lora_A.weight"], experts.gate_proj.lora_A[expert])
        torch.testing.assert_close(tensors[f"{prefix}.down_proj.lora_B.weight"], experts.down_proj.lora_B[expert])
        assert f"model.layers.0.mlp.experts.{expert}.up_proj" in config["target_modules"]
    assert hf_config_from_qwen3_moe(MOE)["num_experts"] == MOE.num_experts


def test_a_linear_adapter_whose_weight_the_mapper_splits_is_refused(tmp_path):
    model, _ = _trained_like(r"model\.layers\.0\.self_attn\.q_proj", moe=False, params=LoRAParameters(r=2))
    name = "model.layers.0.self_attn.q_proj"
    halves = Chunk(f"{name}.weight", [f"{name}_a.weight", f"{name}_b.weight"])  # one d9d linear -> two HF weights
    with pytest.raises(ValueError, match=rf"{name}\.weight: the to-HF mapper splits it into 2 HF weights"):
        export_hf_peft_adapter(model, halves, tmp_path)
    assert not (tmp_path / ADAPTER_WEIGHTS).exists()
