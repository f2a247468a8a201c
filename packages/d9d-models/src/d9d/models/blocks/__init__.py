"""Building blocks: attention, RoPE, norms, feed-forwards, embeddings, heads and loss, mixture of experts."""

from d9d.models.blocks.attention import GroupedQueryAttention
from d9d.models.blocks.checkpointing import run_layer, set_activation_checkpointing
from d9d.models.blocks.embedding import SplitTokenEmbedding
from d9d.models.blocks.ffn import SwiGLU
from d9d.models.blocks.head import LanguageModellingLoss, SplitLanguageModellingHead
from d9d.models.blocks.inputs import CausalLMOutput, positions_within_documents
from d9d.models.blocks.late_init import ModuleLateInit, materialize_
from d9d.models.blocks.loss import IGNORE_INDEX, chunked_linear_cross_entropy
from d9d.models.blocks.norm import RMSNorm
from d9d.models.blocks.rope import RopeStyle, RopeTables, RotaryEmbedding
from d9d.models.blocks.rope_scaling import (
    AnyRopeScaling,
    LinearRopeScaling,
    NtkRopeScaling,
    YarnRopeScaling,
    rope_frequencies,
)

__all__ = [
    "IGNORE_INDEX",
    "AnyRopeScaling",
    "CausalLMOutput",
    "GroupedQueryAttention",
    "LanguageModellingLoss",
    "LinearRopeScaling",
    "ModuleLateInit",
    "NtkRopeScaling",
    "RMSNorm",
    "RopeStyle",
    "RopeTables",
    "RotaryEmbedding",
    "SplitLanguageModellingHead",
    "SplitTokenEmbedding",
    "SwiGLU",
    "YarnRopeScaling",
    "chunked_linear_cross_entropy",
    "materialize_",
    "positions_within_documents",
    "rope_frequencies",
    "run_layer",
    "set_activation_checkpointing",
]
