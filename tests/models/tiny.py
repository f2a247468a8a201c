"""Tiny random Qwen3 / Qwen3-MoE models on both sides (d9d and transformers) and helpers to move tensors."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from d9d.kernels.attention import EagerAttentionConfig
from d9d.kernels.grouped_mm import EagerGroupedMmConfig
from d9d.models import DecoderConfig, PipelineStage, materialize_
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    detect_experts_format,
    mapper_from_huggingface_qwen3_dense,
    mapper_from_huggingface_qwen3_moe,
    mapper_to_huggingface_qwen3_dense,
    mapper_to_huggingface_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.states.mapper import ModelStateMapper

VOCAB = 96
SINGLE = PipelineStage()
EAGER = DecoderConfig(attention=EagerAttentionConfig(), grouped_mm=EagerGroupedMmConfig(), loss_chunk_size=7)

DENSE_HF = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)
MOE_HF = dict(
    DENSE_HF,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)


def map_tensors(mapper: ModelStateMapper, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run every group of `mapper` on in-memory tensors (the mapping, without the checkpoint I/O)."""
    out: dict[str, torch.Tensor] = {}
    for group in mapper.state_dependency_groups():
        out.update(mapper.apply({name: tensors[name] for name in group.inputs}))
    return out


def hf_dense(seed=0, **overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**DENSE_HF, **overrides}, attn_implementation="eager")
    return Qwen3ForCausalLM(config).eval()


def hf_moe(seed=0, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**MOE_HF, **overrides}, attn_implementation="eager")
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # transformers may leave router weights at zero: every token would tie
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
    return model


def d9d_from_hf(hf, *, config=EAGER, stage=SINGLE, state=None):
    """The d9d twin of a transformers model, weights moved through our HF mapper (from `state`, default: the
    model's state dict)."""
    hf_config = hf.config.to_dict()
    is_moe = "num_experts_per_tok" in hf_config
    state = hf.state_dict() if state is None else state
    tied = bool(hf_config.get("tie_word_embeddings"))
    if is_moe:
        params = qwen3_moe_parameters_from_hf(hf_config)
        mapper = mapper_from_huggingface_qwen3_moe(
            params, stage=stage, tied_embeddings=tied, experts_format=detect_experts_format(state)
        )
        cls = Qwen3MoeForCausalLM
    else:
        params = qwen3_dense_parameters_from_hf(hf_config)
        mapper = mapper_from_huggingface_qwen3_dense(params, stage=stage, tied_embeddings=tied)
        cls = Qwen3DenseForCausalLM
    with torch.device("meta"):
        model = cls(params, config=config, stage=stage)
    materialize_(model, "cpu")
    model.load_state_dict(map_tensors(mapper, state), strict=True)
    return model, params


def d9d_tensors_in_hf_names(model, params, hf_state) -> dict[str, torch.Tensor]:
    """Any per-parameter tensors of the d9d model (e.g. gradients) renamed/reshaped into transformers' layout."""
    if hasattr(params, "num_experts"):
        mapper = mapper_to_huggingface_qwen3_moe(params, experts_format=detect_experts_format(hf_state))
    else:
        mapper = mapper_to_huggingface_qwen3_dense(params)
    grads = {name: p.grad for name, p in model.named_parameters()}
    return map_tensors(mapper, grads)
