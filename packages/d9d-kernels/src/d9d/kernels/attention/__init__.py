"""Attention kernels behind one interface: eager reference, PyTorch SDPA (any kernel, or cuDNN only), FlexAttention,
FlashAttention 2 (optional)."""

from d9d.kernels.attention.api import AttentionBackend
from d9d.kernels.attention.config import (
    ATTENTION_CONFIG_ADAPTER,
    AnyAttentionConfig,
    CudnnAttentionConfig,
    EagerAttentionConfig,
    FlashAttention2Config,
    FlexAttentionConfig,
    SdpaAttentionConfig,
    build_attention_backend,
    detect_attention_config,
    resolve_attention_config,
)
from d9d.kernels.attention.cudnn import CudnnAttention
from d9d.kernels.attention.eager import EagerAttention
from d9d.kernels.attention.flash import FlashAttention2
from d9d.kernels.attention.flex import FlexAttention, block_mask_for
from d9d.kernels.attention.mask import AttentionMask
from d9d.kernels.attention.sdpa import SdpaAttention

__all__ = [
    "ATTENTION_CONFIG_ADAPTER",
    "AnyAttentionConfig",
    "AttentionBackend",
    "AttentionMask",
    "CudnnAttention",
    "CudnnAttentionConfig",
    "EagerAttention",
    "EagerAttentionConfig",
    "FlashAttention2",
    "FlashAttention2Config",
    "FlexAttention",
    "FlexAttentionConfig",
    "SdpaAttention",
    "SdpaAttentionConfig",
    "block_mask_for",
    "build_attention_backend",
    "detect_attention_config",
    "resolve_attention_config",
]
