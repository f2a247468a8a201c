"""Hyperparameters of the Qwen3 families (`*Parameters`; unknown keys rejected)."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.models.blocks.moe.router import RouterScoring
from d9d.models.blocks.rope import RopeStyle
from d9d.models.blocks.rope_scaling import AnyRopeScaling


class Qwen3DenseParameters(BaseModel):
    """Qwen3 dense. `vocab_segments` splits the vocabulary into separately trainable tables (default: one,
    'regular'); their sizes must add up to `vocab_size`. `rotary_dim` below `head_dim` rotates only part of a head."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: AnyRopeScaling | None = None
    rope_style: RopeStyle = RopeStyle.HALF
    rotary_dim: int | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    qk_norm: bool = True
    vocab_segments: dict[str, int] | None = None
    init_std: float = 0.02

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.vocab_segments is not None and sum(self.vocab_segments.values()) != self.vocab_size:
            raise ValueError(
                f"vocab_segments {self.vocab_segments} add up to {sum(self.vocab_segments.values())}, "
                f"not vocab_size={self.vocab_size}"
            )
        return self

    def segments(self) -> dict[str, int]:
        return dict(self.vocab_segments) if self.vocab_segments is not None else {"regular": self.vocab_size}


class Qwen3MoeParameters(Qwen3DenseParameters):
    """Qwen3-MoE. Layer `i` is an MoE layer unless `i in mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`
    (then a dense SwiGLU of `intermediate_size`). Experts have `moe_intermediate_size`; a positive
    `shared_expert_intermediate_size` adds an always-on shared expert (not in the Hugging Face Qwen3-MoE layout)."""

    num_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = Field(default=1, gt=0)
    mlp_only_layers: list[int] = Field(default_factory=list)
    router_scoring: RouterScoring = RouterScoring.SOFTMAX
    router_expert_bias: bool = False
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    load_balancing_coef: float = Field(default=0.0, ge=0)
    z_loss_coef: float = Field(default=0.0, ge=0)

    def is_moe_layer(self, index: int) -> bool:
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
