"""Qwen3-MoE: decoder layer (MoE or dense feed-forward), backbone and causal LM."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.attention import AttentionBackend, AttentionMask, build_attention_backend
from d9d.kernels.grouped_mm import GroupedMm, build_grouped_mm
from d9d.models.blocks.decoder import DecoderBackbone, DecoderForCausalLM
from d9d.models.blocks.ffn import SwiGLU
from d9d.models.blocks.moe import MoELayer
from d9d.models.blocks.norm import RMSNorm
from d9d.models.blocks.rope import RopeTables
from d9d.models.config import DecoderConfig
from d9d.models.qwen3.dense import build_attention, build_rotary
from d9d.models.qwen3.params import Qwen3MoeParameters
from d9d.models.roles import Role, with_role
from d9d.models.stage import SINGLE_STAGE, PipelineStage


def build_moe(params: Qwen3MoeParameters, grouped_mm: GroupedMm, config: DecoderConfig | None = None) -> MoELayer:
    config = config or DecoderConfig()
    moe = MoELayer(
        hidden_size=params.hidden_size,
        num_experts=params.num_experts,
        top_k=params.num_experts_per_tok,
        expert_intermediate_size=params.moe_intermediate_size,
        grouped_mm=grouped_mm,
        scoring=params.router_scoring,
        normalize_top_k=params.norm_topk_prob,
        expert_bias=params.router_expert_bias,
        shared_intermediate_size=params.shared_expert_intermediate_size,
        load_balancing_coef=params.load_balancing_coef,
        z_loss_coef=params.z_loss_coef,
        init_std=params.init_std,
        capacity_factor=config.moe_capacity_factor,
        dispatch_config=config.expert_dispatch,
    )
    with_role(moe.experts, Role.EXPERTS)
    return with_role(moe, Role.MOE)


class Qwen3MoeLayer(nn.Module):
    """Pre-norm attention, then a pre-norm MoE (or, on dense layers, a SwiGLU), each with a residual."""

    def __init__(
        self,
        params: Qwen3MoeParameters,
        index: int,
        attention: AttentionBackend,
        grouped_mm: GroupedMm,
        config: DecoderConfig | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps)
        self.self_attn = build_attention(params, attention)
        self.post_attention_layernorm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps)
        self.mlp: MoELayer | SwiGLU = (
            build_moe(params, grouped_mm, config)
            if params.is_moe_layer(index)
            else SwiGLU(params.hidden_size, params.intermediate_size, init_std=params.init_std)
        )

    def forward(self, hidden: torch.Tensor, rope: RopeTables, mask: AttentionMask) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, mask)
        normed, hidden = self.post_attention_layernorm.add_and_norm(attended, hidden)  # one kernel: add, then norm
        out: torch.Tensor = hidden + self.mlp(normed)
        return out


class Qwen3MoeModel(DecoderBackbone):
    """The backbone: embedding (first stage), this stage's Qwen3-MoE layers, final norm (last stage)."""

    def __init__(
        self,
        params: Qwen3MoeParameters,
        *,
        config: DecoderConfig | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        config = config or DecoderConfig()
        attention = build_attention_backend(config.attention)
        grouped_mm = build_grouped_mm(config.grouped_mm)
        super().__init__(
            params,
            config=config,
            stage=stage,
            rotary=build_rotary(params),
            build_layer=lambda index: Qwen3MoeLayer(params, index, attention, grouped_mm, config),
        )

    def moe_layers(self) -> dict[str, MoELayer]:
        """The MoE feed-forwards of this stage by layer index (for load logging and bias updates)."""
        return {
            index: layer.mlp
            for index, layer in self.layers.items()
            if isinstance(layer, Qwen3MoeLayer) and isinstance(layer.mlp, MoELayer)
        }


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE backbone plus the LM head (last stage). The losses (per token and their sum) when given labels,
    else logits."""

    model: Qwen3MoeModel

    def __init__(
        self,
        params: Qwen3MoeParameters,
        *,
        config: DecoderConfig | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        config = config or DecoderConfig()
        super().__init__(Qwen3MoeModel(params, config=config, stage=stage), params, config=config, stage=stage)
