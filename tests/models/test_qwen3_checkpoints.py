"""Checkpoints on disk through d9d-states: Hugging Face -> d9d -> Hugging Face, per pipeline stage, both expert
layouts, configs both ways."""

import json

import pytest
import torch
from tiny import EAGER, VOCAB, d9d_from_hf, hf_dense, hf_moe, map_tensors

from d9d.models import PipelineStage, materialize_
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeExpertsFormat,
    Qwen3MoeForCausalLM,
    hf_config_from_qwen3_dense,
    hf_config_from_qwen3_moe,
    mapper_from_huggingface_qwen3_dense,
    mapper_from_huggingface_qwen3_moe,
    mapper_to_huggingface_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.models.qwen3.huggingface import mapper_to_huggingface_qwen3_dense
from d9d.states import load_model_state, save_model_state

IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def _export(model, params, directory):
    if hasattr(params, "num_experts"):
        mapper, config = mapper_to_huggingface_qwen3_moe(params), hf_config_from_qwen3_moe(params, dtype=torch.float32)
    else:
        mapper, config = (
            mapper_to_huggingface_qwen3_dense(params),
            hf_config_from_qwen3_dense(params, dtype=torch.float32),
        )
    save_model_state(directory, model, mapper)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_export_to_hf_layout_loads_in_transformers_with_the_same_logits(family, tmp_path):
    import transformers

    hf = hf_dense(seed=4) if family == "dense" else hf_moe(seed=4)
    model, params = d9d_from_hf(hf)
    with torch.no_grad():  # train-like drift so the export is not just the import echoed back
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    _export(model, params, tmp_path / "export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    assert loaded.dtype == torch.float32
    assert type(loaded).__name__ == type(hf).__name__
    torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, **FP32)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_checkpoint_on_disk_loads_through_the_mapper(tied, tmp_path):
    hf = hf_moe(seed=5, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    params = qwen3_moe_parameters_from_hf(config)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(params, config=EAGER)
    materialize_(model, "cpu")
    mapper = mapper_from_huggingface_qwen3_moe(params, tied_embeddings=config["tie_word_embeddings"])
    load_model_state(tmp_path / "hf", model, mapper)
    torch.testing.assert_close(model(IDS).logits, hf(IDS).logits, **FP32)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_each_pipeline_stage_builds_only_its_layers_and_loads_alone(family, tmp_path):
    hf = hf_dense(seed=6, num_hidden_layers=5) if family == "dense" else hf_moe(seed=6, num_hidden_layers=5)
    hf.save_pretrained(tmp_path / "hf")
    full, params = d9d_from_hf(hf)
    cls = Qwen3DenseForCausalLM if family == "dense" else Qwen3MoeForCausalLM
    mapper_of = mapper_from_huggingface_qwen3_dense if family == "dense" else mapper_from_huggingface_qwen3_moe
    stages, keys, layers = [], set(), []
    for index in range(3):
        stage = PipelineStage(index, 3, virtual_layers_pre=1, virtual_layers_post=1)
        with torch.device("meta"):
            part = cls(params, config=EAGER, stage=stage)
        materialize_(part, "cpu")
        report = load_model_state(tmp_path / "hf", part, mapper_of(params, stage=stage), allow_unused=True)
        assert report.tensors == len(part.state_dict())
        assert keys.isdisjoint(part.state_dict())
        keys |= part.state_dict().keys()
        layers.append([int(i) for i in part.model.layers])
        stages.append(part)
    assert layers == [[0, 1], [2, 3], [4]]  # 7 slots (embedding + 5 layers + head) over 3 stages
    assert keys == full.state_dict().keys()
    assert stages[0].lm_head is None and stages[1].model.embed_tokens is None and stages[2].model.norm is not None
    hidden = stages[0](IDS).hidden_states
    hidden = stages[1](hidden_states=hidden).hidden_states
    torch.testing.assert_close(stages[2](hidden_states=hidden).logits, hf(IDS).logits, **FP32)


def test_last_stage_of_a_tied_checkpoint_reads_the_embedding_as_its_head():
    hf = hf_dense(seed=7, tie_word_embeddings=True)
    params = qwen3_dense_parameters_from_hf(hf.config.to_dict())
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    stage = PipelineStage(1, 2)
    mapped = map_tensors(mapper_from_huggingface_qwen3_dense(params, stage=stage, tied_embeddings=True), state)
    assert "model.embed_tokens.segments.regular.weight" not in mapped
    torch.testing.assert_close(mapped["lm_head.segments.regular.weight"], state["model.embed_tokens.weight"])


def test_fused_and_per_expert_layouts_map_to_the_same_d9d_tensors():
    hf = hf_moe(seed=8)
    params = qwen3_moe_parameters_from_hf(hf.config.to_dict())
    model, _ = d9d_from_hf(hf)
    fused = map_tensors(
        mapper_to_huggingface_qwen3_moe(params, experts_format=Qwen3MoeExpertsFormat.FUSED), model.state_dict()
    )
    per_expert = map_tensors(mapper_to_huggingface_qwen3_moe(params), model.state_dict())
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert per_expert["model.layers.0.mlp.experts.3.up_proj.weight"].shape == (32, 64)
    torch.testing.assert_close(
        fused["model.layers.0.mlp.experts.gate_up_proj"][3, 32:],
        per_expert["model.layers.0.mlp.experts.3.up_proj.weight"],
    )
    for layout, tensors in ((Qwen3MoeExpertsFormat.FUSED, fused), (Qwen3MoeExpertsFormat.PER_EXPERT, per_expert)):
        back = map_tensors(mapper_from_huggingface_qwen3_moe(params, experts_format=layout), tensors)
        assert back.keys() == model.state_dict().keys()
        for name, tensor in model.state_dict().items():
            assert torch.equal(back[name], tensor), name


def test_hf_config_round_trips_through_parameters():
    from transformers import Qwen3MoeConfig

    hf_config = Qwen3MoeConfig(
        **{k: v for k, v in hf_moe().config.to_dict().items() if k in Qwen3MoeConfig().to_dict()},
    ).to_dict()
    hf_config["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 5e5,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    params = qwen3_moe_parameters_from_hf(hf_config)
    assert params.rope_scaling is not None and params.rope_scaling.kind == "yarn"
    assert params.num_experts == 8 and params.mlp_only_layers == [1] and params.norm_topk_prob
    again = qwen3_moe_parameters_from_hf(hf_config_from_qwen3_moe(params))
    assert again == params
    legacy = {
        **hf_config,
        "rope_parameters": None,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    assert qwen3_moe_parameters_from_hf(legacy).rope_scaling.factor == 2.0


def test_unsupported_rope_type_is_refused_by_name():
    config = {**hf_dense().config.to_dict(), "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match=r"'longrope'.*supported: default, linear, yarn"):
        qwen3_dense_parameters_from_hf(config)


def test_moe_features_outside_the_hf_layout_are_refused_on_export():
    params = qwen3_moe_parameters_from_hf(hf_moe().config.to_dict())
    shared = params.model_copy(update={"shared_expert_intermediate_size": 16})
    with pytest.raises(ValueError, match="no shared experts"):
        mapper_to_huggingface_qwen3_moe(shared)
