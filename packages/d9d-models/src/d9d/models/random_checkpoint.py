"""A randomly initialised model written as a Hugging Face checkpoint by d9d's own mapper (no transformers needed).

The embedded default of the convert stage uses it, so the stage converts a real checkpoint on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from d9d.core.checkpoint import write_durable
from d9d.core.dist import on_first_rank
from d9d.models.blocks.late_init import materialize_
from d9d.models.qwen3.dense import Qwen3DenseForCausalLM
from d9d.models.qwen3.huggingface import (
    hf_config_from_qwen3_dense,
    hf_config_from_qwen3_moe,
    mapper_to_huggingface_qwen3_dense,
    mapper_to_huggingface_qwen3_moe,
)
from d9d.models.qwen3.moe import Qwen3MoeForCausalLM
from d9d.models.qwen3.params import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.states import save_model_state

TINY_QWEN3_MOE = Qwen3MoeParameters(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)


def write_random_hf_checkpoint(
    destination: Path | str,
    params: Qwen3DenseParameters = TINY_QWEN3_MOE,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Initialise a Qwen3 (dense or MoE, by the type of `params`) from `seed` and write it in the Hugging Face
    layout at `destination`: the safetensors files (and index) appear at once, then `config.json`. Collective in a
    process group (every rank calls it): the ranks write the tensors together, the first rank writes `config.json`
    (atomically), and every rank returns once it exists."""
    destination = Path(destination)
    torch.manual_seed(seed)
    if isinstance(params, Qwen3MoeParameters):
        with torch.device("meta"):
            model: torch.nn.Module = Qwen3MoeForCausalLM(params)
        mapper, config = mapper_to_huggingface_qwen3_moe(params), hf_config_from_qwen3_moe(params, dtype=dtype)
    else:
        with torch.device("meta"):
            model = Qwen3DenseForCausalLM(params)
        mapper, config = mapper_to_huggingface_qwen3_dense(params), hf_config_from_qwen3_dense(params, dtype=dtype)
    materialize_(model, "cpu")
    state = {name: tensor.to(dtype) for name, tensor in model.state_dict().items()}
    save_model_state(destination, state, mapper, overwrite=overwrite)
    text = (json.dumps(config, indent=2) + "\n").encode("utf-8")
    on_first_rank(lambda: write_durable(destination / "config.json", text))
    return destination
