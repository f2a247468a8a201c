"""Named conversions (`d9d convert`): a random Hugging Face checkpoint written by our mapper, to d9d and back."""

import json

import pytest
import torch

from d9d.models import materialize_
from d9d.models.catalogue import read_parameters
from d9d.models.conversions import NAMED_MAPPINGS, describe_mappings, named_mapping
from d9d.models.qwen3 import Qwen3DenseParameters, Qwen3MoeForCausalLM
from d9d.models.random_checkpoint import TINY_QWEN3_MOE, write_random_hf_checkpoint
from d9d.states import MappingError, convert_checkpoint, load_model_state
from d9d.states.io.source import CheckpointSource

DENSE = Qwen3DenseParameters(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def _convert(name, source, destination):
    mapping = named_mapping(name)
    convert_checkpoint(source, destination, mapping.factory)
    mapping.convert_config(source, destination, torch.float32)


def test_catalogue_lists_the_qwen3_conversions():
    assert {"qwen3-hf-to-d9d", "qwen3-d9d-to-hf", "qwen3-moe-hf-to-d9d", "qwen3-moe-d9d-to-hf"} <= NAMED_MAPPINGS.keys()
    assert "qwen3-moe-d9d-to-hf-fused" in describe_mappings()
    with pytest.raises(KeyError, match="no mapping named 'llama'; valid: qwen3-hf-to-d9d"):
        named_mapping("llama")


def test_moe_round_trip_through_named_mappings_is_exact(tmp_path):
    write_random_hf_checkpoint(tmp_path / "hf", TINY_QWEN3_MOE, seed=3, dtype=torch.float32)
    _convert("qwen3-moe-hf-to-d9d", tmp_path / "hf", tmp_path / "d9d")
    params = read_parameters(tmp_path / "d9d")
    assert params == TINY_QWEN3_MOE
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(params)
    materialize_(model, "cpu")
    load_model_state(tmp_path / "d9d", model)  # d9d names: no mapping needed
    torch.manual_seed(3)
    with torch.device("meta"):
        original = Qwen3MoeForCausalLM(params)
    materialize_(original, "cpu")
    for name, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    _convert("qwen3-moe-d9d-to-hf", tmp_path / "d9d", tmp_path / "back")
    first, back = CheckpointSource.open(tmp_path / "hf"), CheckpointSource.open(tmp_path / "back")
    assert first.metas() == back.metas()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_experts"] == 4
    _convert("qwen3-moe-d9d-to-hf-fused", tmp_path / "d9d", tmp_path / "fused")
    assert "model.layers.0.mlp.experts.gate_up_proj" in CheckpointSource.open(tmp_path / "fused").metas()
    _convert("qwen3-moe-hf-to-d9d", tmp_path / "fused", tmp_path / "d9d-again")
    assert CheckpointSource.open(tmp_path / "d9d-again").metas() == CheckpointSource.open(tmp_path / "d9d").metas()


def test_family_mismatch_names_the_right_mapping(tmp_path):
    write_random_hf_checkpoint(tmp_path / "dense", DENSE, dtype=torch.float32)
    with pytest.raises(MappingError, match="has no MoE layers; use 'qwen3-hf-to-d9d'"):
        convert_checkpoint(tmp_path / "dense", tmp_path / "out", named_mapping("qwen3-moe-hf-to-d9d").factory)
    _convert("qwen3-hf-to-d9d", tmp_path / "dense", tmp_path / "d9d")
    assert read_parameters(tmp_path / "d9d") == DENSE
