"""Qwen3 dense: decoder layer, backbone and causal LM. Read top to bottom; the blocks hold the details."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.attention import AttentionBackend, AttentionMask, build_attention_backend
from d9d.models.blocks.attention import GroupedQueryAttention
from d9d.models.blocks.decoder import DecoderBackbone, DecoderForCausalLM
from d9d.models.blocks.ffn import SwiGLU
from d9d.models.blocks.norm import RMSNorm
from d9d.models.blocks.rope import RopeTables, RotaryEmbedding
from d9d.models.config import DecoderConfig
from d9d.models.qwen3.params import Qwen3DenseParameters
from d9d.models.roles import Role, with_role
from d9d.models.stage import SINGLE_STAGE, PipelineStage


def build_attention(params: Qwen3DenseParameters, backend: AttentionBackend) -> GroupedQueryAttention:
    attention = GroupedQueryAttention(
        hidden_size=params.hidden_size,
        num_heads=params.num_attention_heads,
        num_kv_heads=params.num_key_value_heads,
        head_dim=params.head_dim,
        backend=backend,
        qk_norm=params.qk_norm,
        norm_eps=params.rms_norm_eps,
        bias=params.attention_bias,
        init_std=params.init_std,
    )
    return with_role(attention, Role.ATTENTION)


def build_rotary(params: Qwen3DenseParameters) -> RotaryEmbedding:
    return RotaryEmbedding(
        head_dim=params.head_dim,
        theta=params.rope_theta,
        rotary_dim=params.rotary_dim,
        scaling=params.rope_scaling,
        style=params.rope_style,
    )


class Qwen3DenseLayer(nn.Module):
    """Pre-norm attention, then pre-norm SwiGLU, each with a residual connection."""

    def __init__(self, params: Qwen3DenseParameters, attention: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps)
        self.self_attn = build_attention(params, attention)
        self.post_attention_layernorm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps)
        self.mlp = SwiGLU(params.hidden_size, params.intermediate_size, init_std=params.init_std)

    def forward(self, hidden: torch.Tensor, rope: RopeTables, mask: AttentionMask) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, mask)
        normed, hidden = self.post_attention_layernorm.add_and_norm(attended, hidden)  # one kernel: add, then norm
        out: torch.Tensor = hidden + self.mlp(normed)
        return out


class Qwen3DenseModel(DecoderBackbone):
    """The backbone: embedding (first stage), this stage's Qwen3 dense layers, final norm (last stage)."""

    def __init__(
        self,
        params: Qwen3DenseParameters,
        *,
        config: DecoderConfig | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        config = config or DecoderConfig()
        attention = build_attention_backend(config.attention)
        super().__init__(
            params,
            config=config,
            stage=stage,
            rotary=build_rotary(params),
            build_layer=lambda _index: Qwen3DenseLayer(params, attention),
        )


class Qwen3DenseForCausalLM(DecoderForCausalLM):
    """Qwen3 dense backbone plus the LM head (last stage). The losses (per token and their sum) when given labels,
    else logits."""

    model: Qwen3DenseModel

    def __init__(
        self,
        params: Qwen3DenseParameters,
        *,
        config: DecoderConfig | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        config = config or DecoderConfig()
        super().__init__(Qwen3DenseModel(params, config=config, stage=stage), params, config=config, stage=stage)
