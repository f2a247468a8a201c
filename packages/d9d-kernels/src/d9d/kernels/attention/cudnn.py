"""cuDNN attention through PyTorch's SDPA, with the backend pinned to cuDNN (faster than flash on Hopper).

`scaled_dot_product_attention` picks among its kernels by a priority list; this backend restricts the list to
`SDPBackend.CUDNN_ATTENTION`, so a shape or dtype cuDNN refuses fails loudly instead of silently running another
kernel. CUDA only; document masks go in as a dense boolean mask (cuDNN takes it as a bias).
"""

from __future__ import annotations

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from d9d.kernels.attention.api import check_heads
from d9d.kernels.attention.mask import AttentionMask


class CudnnAttention:
    name = "cudnn"

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: AttentionMask, scale: float
    ) -> torch.Tensor:
        groups = check_heads(query, key, value)
        if query.device.type != "cuda":
            raise ValueError(
                f"the attention backend 'cudnn' runs on CUDA tensors only, got a tensor on {query.device}; choose "
                "kind='sdpa' (or leave attention unset) for other devices"
            )
        q, k, v = (tensor.transpose(1, 2) for tensor in (query, key, value))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            if mask.is_plain_causal or (not mask.causal and mask.document_ids is None):
                out = functional.scaled_dot_product_attention(
                    q, k, v, is_causal=mask.causal, scale=scale, enable_gqa=groups > 1
                )
            else:
                allowed = mask.dense(query.shape[1], query.device)
                out = functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed, scale=scale, enable_gqa=groups > 1
                )
        return out.transpose(1, 2)
