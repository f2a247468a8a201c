"""Qwen3 dense: decoder layer, backbone and causal LM. Read top to bottom; the blocks hold the details."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.attention import AttentionBackend, AttentionMask, build_attention_backend
from d9d.models.blocks.attention import GroupedQueryAttention
from d9d.models.blocks.checkpointing import run_layer, set_activation_checkpointing
from d9d.models.blocks.embedding import SplitTokenEmbedding
from d9d.models.blocks.ffn import SwiGLU
from d9d.models.blocks.head import SplitLanguageModellingHead
from d9d.models.blocks.inputs import CausalLMOutput, causal_mask, resolve_positions
from d9d.models.blocks.norm import RMSNorm
from d9d.models.blocks.rope import RopeTables, RotaryEmbedding
from d9d.models.config import DecoderConfig
from d9d.models.qwen3.params import Qwen3DenseParameters
from d9d.models.roles import Role, with_role
from d9d.models.stage import SINGLE_STAGE, PipelineStage


def build_attention(params: Qwen3DenseParameters, backend: AttentionBackend) -> GroupedQueryAttention:
    return GroupedQueryAttention(
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
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, mask)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class Qwen3DenseModel(nn.Module):
    """The backbone: embedding (first stage), this stage's layers, final norm (last stage)."""

    def __init__(
        self,
        params: Qwen3DenseParameters,
        *,
        config: DecoderConfig | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        super().__init__()
        config = config or DecoderConfig()
        self.params, self.stage = params, stage
        attention = build_attention_backend(config.attention)
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
            layer = with_role(Qwen3DenseLayer(params, attention), Role.DECODER_LAYER)
            set_activation_checkpointing(layer, config.checkpoints_layer(index))
            self.layers[str(index)] = layer
        self.norm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps) if stage.is_last else None

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


class Qwen3DenseForCausalLM(nn.Module):
    """Backbone plus the LM head (last stage). Returns per-token losses when given labels, else logits."""

    def __init__(
        self,
        params: Qwen3DenseParameters,
        *,
        config: DecoderConfig | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        super().__init__()
        config = config or DecoderConfig()
        self.model = Qwen3DenseModel(params, config=config, stage=stage)
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
