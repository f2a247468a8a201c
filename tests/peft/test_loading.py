"""Base checkpoints load unchanged into the injected model (d9d-layout safetensors and HF layout through the
model's mapper); the trained parameters save and load on their own."""

import pytest
import torch
from peft_models import ATTENTION, DENSE, build, logits, tokens

from d9d.models.qwen3 import mapper_from_huggingface_qwen3_dense, mapper_to_huggingface_qwen3_dense
from d9d.peft import LoRAConfig, build_peft_method, inject_peft_and_freeze
from d9d.peft.loading import load_base_state, load_trainable_state, save_trainable_state
from d9d.states import StateMismatchError, save_model_state


def _injected(seed: int = 7):
    method = build_peft_method(LoRAConfig(module_name_pattern=ATTENTION))
    injections = []
    model = build(False, lambda model: injections.append(inject_peft_and_freeze(method, model)), seed=seed)
    return model, injections[0]


def test_a_d9d_base_checkpoint_loads_unchanged_and_gives_the_base_outputs(tmp_path):
    base = build(False, seed=0)
    save_model_state(tmp_path / "base", base)
    model, injection = _injected()
    report = load_base_state(tmp_path / "base", model, injection)
    assert report.tensors == len(base.state_dict())
    torch.testing.assert_close(logits(model, tokens()), logits(base, tokens()), rtol=0, atol=0)


def test_an_hf_base_checkpoint_loads_through_the_models_mapper(tmp_path):
    base = build(False, seed=0)
    save_model_state(tmp_path / "hf", base, mapper_to_huggingface_qwen3_dense(DENSE))
    model, injection = _injected()
    load_base_state(tmp_path / "hf", model, injection, mapper_from_huggingface_qwen3_dense(DENSE))
    torch.testing.assert_close(logits(model, tokens()), logits(base, tokens()), rtol=0, atol=0)


def test_a_base_checkpoint_missing_a_weight_is_refused(tmp_path):
    base = build(False, seed=0)
    state = {name: value for name, value in base.state_dict().items() if name != "model.norm.weight"}
    save_model_state(tmp_path / "partial", state)
    model, injection = _injected()
    with pytest.raises(StateMismatchError, match=r"the mapping reads 'model\.norm\.weight', which .* does not have"):
        load_base_state(tmp_path / "partial", model, injection)


def test_trained_parameters_save_alone_and_restore_on_top_of_the_base(tmp_path):
    model, _ = _injected()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_()
    save_trainable_state(tmp_path / "adapter", model)
    restored, _ = _injected()  # same base weights (seed), fresh adapters
    report = load_trainable_state(tmp_path / "adapter", restored)
    assert report.tensors == 16  # A and B of 4 projections in 2 layers
    torch.testing.assert_close(logits(restored, tokens()), logits(model, tokens()), rtol=0, atol=0)


def test_trained_parameters_missing_from_the_file_are_refused_by_name(tmp_path):
    q_and_v = build_peft_method(LoRAConfig(module_name_pattern=r".*\.self_attn\.(q|v)_proj"))
    saved = build(False, lambda model: inject_peft_and_freeze(q_and_v, model), seed=7)
    save_trainable_state(tmp_path / "adapter", saved)
    model, _ = _injected()  # adapters on q, k, v and o: those of k and o are not in the file
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(
        StateMismatchError, match=r"lacks 8 of the model's 16 trainable .*'model\.layers\.0\.self_attn\.k_proj\.lora_A'"
    ):
        load_trainable_state(tmp_path / "adapter", model)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())  # nothing loaded
