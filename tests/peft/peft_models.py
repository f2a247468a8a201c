"""Tiny Qwen3 dense / MoE models for the PEFT tests, built the d9d way (meta -> inject -> materialise)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from d9d.kernels.attention import EagerAttentionConfig
from d9d.kernels.grouped_mm import EagerGroupedMmConfig
from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters, Qwen3MoeForCausalLM, Qwen3MoeParameters

VOCAB = 64
EAGER = DecoderConfig(attention=EagerAttentionConfig(), grouped_mm=EagerGroupedMmConfig())
DENSE = Qwen3DenseParameters(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)  # fmt: skip
MOE = Qwen3MoeParameters(
    **DENSE.model_dump(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
)  # fmt: skip
ATTENTION = r".*\.self_attn\.(q|k|v|o)_proj"
EXPERTS = r".*\.mlp\.experts\.(gate|up|down)_proj"


def build(moe: bool, prepare: Callable[[nn.Module], object] | None = None, seed: int = 0) -> nn.Module:
    """Meta -> `prepare` (injection) -> materialise on CPU with `seed`."""
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(MOE, config=EAGER) if moe else Qwen3DenseForCausalLM(DENSE, config=EAGER)
    if prepare is not None:
        prepare(model)
    torch.manual_seed(seed)
    return materialize_(model, "cpu")


def tokens(rows: int = 3, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(ids).logits
    return out
