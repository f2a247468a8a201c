"""Autoregressive generation for the catalogue's causal LMs: a static-shape KV cache, sampling, stopping."""

from d9d.models.generation.cache import CachedAttention, DecodeState, attach_kv_cache
from d9d.models.generation.generate import (
    FinishReason,
    GenerationConfig,
    GenerationResult,
    check_whole_sequences,
    generate,
)
from d9d.models.generation.sampling import SamplingConfig, filter_logits, next_tokens

__all__ = [
    "CachedAttention",
    "DecodeState",
    "FinishReason",
    "GenerationConfig",
    "GenerationResult",
    "SamplingConfig",
    "attach_kv_cache",
    "check_whole_sequences",
    "filter_logits",
    "generate",
    "next_tokens",
]
