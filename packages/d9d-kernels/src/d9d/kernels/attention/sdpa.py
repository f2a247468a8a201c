"""PyTorch's `scaled_dot_product_attention`: flash and cuDNN kernels on GPUs, a fused CPU kernel, math fallback."""

from __future__ import annotations

import torch
from torch.nn import functional

from d9d.kernels.attention.api import check_heads
from d9d.kernels.attention.mask import AttentionMask


class SdpaAttention:
    """Plain causal attention runs in SDPA's causal mode with native grouped heads (`enable_gqa`), which the flash
    kernel serves. Document masks need a dense boolean mask, which that kernel cannot take; key/value heads are then
    expanded so the memory-efficient kernel can.
    """

    name = "sdpa"

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: AttentionMask, scale: float
    ) -> torch.Tensor:
        groups = check_heads(query, key, value)
        q, k, v = (tensor.transpose(1, 2) for tensor in (query, key, value))
        if mask.is_plain_causal or (not mask.causal and mask.document_ids is None):
            out = functional.scaled_dot_product_attention(
                q, k, v, is_causal=mask.causal, scale=scale, enable_gqa=groups > 1
            )
        else:
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            allowed = mask.dense(query.shape[1], query.device)
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        return out.transpose(1, 2)
