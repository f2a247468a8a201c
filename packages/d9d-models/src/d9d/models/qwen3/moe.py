"""Qwen3-MoE: decoder layer (MoE or dense feed-forward), backbone and causal LM."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.attention import AttentionBackend, AttentionMask, build_attention_backend
from d9d.kernels.grouped_mm import GroupedMm, build_grouped_mm
from d9d.models.blocks.checkpointing import run_layer, set_activation_checkpointing
from d9d.models.blocks.embedding import SplitTokenEmbedding
from d9d.models.blocks.ffn import SwiGLU
from d9d.models.blocks.head import SplitLanguageModellingHead
from d9d.models.blocks.inputs import CausalLMOutput, causal_mask, resolve_positions
from d9d.models.blocks.moe import MoELayer
from d9d.models.blocks.norm import RMSNorm
from d9d.models.blocks.rope import RopeTables
from d9d.models.config import DecoderConfig
from d9d.models.qwen3.dense import build_attention, build_rotary
from d9d.models.qwen3.params import Qwen3MoeParameters
from d9d.models.roles import Role, with_role
from d9d.models.stage import SINGLE_STAGE, PipelineStage


def build_moe(params: Qwen3MoeParameters, grouped_mm: GroupedMm) -> MoELayer:
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
    )
    with_role(moe.experts, Role.EXPERTS)
    return with_role(moe, Role.MOE)


class Qwen3MoeLayer(nn.Module):
    """Pre-norm attention, then a pre-norm MoE (or, on dense layers, a SwiGLU), each with a residual."""

    def __init__(
        self, params: Qwen3MoeParameters, index: int, attention: AttentionBackend, grouped_mm: GroupedMm
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps)
        self.self_attn = build_attention(params, attention)
        self.post_attention_layernorm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps)
        self.mlp: MoELayer | SwiGLU = (
            build_moe(params, grouped_mm)
            if params.is_moe_layer(index)
            else SwiGLU(params.hidden_size, params.intermediate_size, init_std=params.init_std)
        )

    def forward(self, hidden: torch.Tensor, rope: RopeTables, mask: AttentionMask) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, mask)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class Qwen3MoeModel(nn.Module):
    """The backbone: embedding (first stage), this stage's layers, final norm (last stage)."""

    def __init__(
        self,
        params: Qwen3MoeParameters,
        *,
        config: DecoderConfig | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        super().__init__()
        config = config or DecoderConfig()
        self.params, self.stage = params, stage
        attention = build_attention_backend(config.attention)
        grouped_mm = build_grouped_mm(config.grouped_mm)
        self.embed_tokens = (
            with_role(
                SplitTokenEmbedding(params.segments(), params.hidden_size, init_std=params.init_std), Role.EMBEDDING
            )
            if stage.is_first
            else None
        )
        self.rotary_emb = build_rotary(params)
        self.layers = nn.ModuleDict()
        for index in stage.layers(params.num_layers):
            layer = with_role(Qwen3MoeLayer(params, index, attention, grouped_mm), Role.DECODER_LAYER)
            set_activation_checkpointing(layer, config.checkpoints_layer(index))
            self.layers[str(index)] = layer
        self.norm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps) if stage.is_last else None

    def moe_layers(self) -> dict[str, MoELayer]:
        """The MoE feed-forwards of this stage by layer index (for load logging and bias updates)."""
        return {
            index: layer.mlp
            for index, layer in self.layers.items()
            if isinstance(layer, Qwen3MoeLayer) and isinstance(layer.mlp, MoELayer)
        }

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids` on the first stage, else the previous stage's `hidden_states`; `(batch, seq, hidden)` out."""
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first stage needs input_ids")
            hidden: torch.Tensor = self.embed_tokens(input_ids)
        elif hidden_states is not None:
            hidden = hidden_states
        else:
            raise ValueError(
                f"stage {self.stage.index} of {self.stage.count} needs hidden_states from the previous stage"
            )
        batch, seq = hidden.shape[:2]
        positions = resolve_positions(batch, seq, hidden.device, position_ids, document_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        mask = causal_mask(document_ids)
        for layer in self.layers.values():
            hidden = run_layer(layer, hidden, rope, mask)
        if self.norm is not None:
            normed: torch.Tensor = self.norm(hidden)
            return normed
        return hidden


class Qwen3MoeForCausalLM(nn.Module):
    """Backbone plus the LM head (last stage). Returns per-token losses when given labels, else logits."""

    def __init__(
        self,
        params: Qwen3MoeParameters,
        *,
        config: DecoderConfig | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        super().__init__()
        config = config or DecoderConfig()
        self.model = Qwen3MoeModel(params, config=config, stage=stage)
        self.lm_head = (
            with_role(
                SplitLanguageModellingHead(
                    params.segments(),
                    params.hidden_size,
                    init_std=params.init_std,
                    loss_chunk_size=config.loss_chunk_size,
                ),
                Role.LM_HEAD,
            )
            if stage.is_last
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """`labels[b, t]` is the target of position `t` (already shifted), -100 for none."""
        hidden = self.model(
            input_ids, hidden_states=hidden_states, position_ids=position_ids, document_ids=document_ids
        )
        if self.lm_head is None:
            return CausalLMOutput(hidden_states=hidden)
        if labels is not None:
            return CausalLMOutput(losses=self.lm_head(hidden, labels))
        return CausalLMOutput(logits=self.lm_head.logits(hidden))
