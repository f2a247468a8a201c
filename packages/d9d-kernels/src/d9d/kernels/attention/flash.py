"""FlashAttention 2 (the `flash_attn` package, an optional extra), imported on first use.

Packed documents use its variable-length kernel, so no dense mask is ever built. CUDA only, fp16/bf16 only.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from d9d.kernels.attention.api import check_heads
from d9d.kernels.attention.mask import AttentionMask
from d9d.kernels.errors import BackendUnavailable

INSTALL_HINT = "install it with `pip install d9d-kernels[flash-attn]` (needs CUDA and a compiler or a matching wheel)"


def import_flash_attn() -> Any:
    try:
        flash_attn = importlib.import_module("flash_attn")
    except ImportError as error:
        raise BackendUnavailable(
            f"the attention backend 'flash_attn_2' needs the flash_attn package, which is not importable ({error}); "
            f"{INSTALL_HINT}, or choose kind='sdpa'"
        ) from error
    return flash_attn


class FlashAttention2:
    name = "flash_attn_2"

    def __init__(self) -> None:
        self._module = import_flash_attn()

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: AttentionMask, scale: float
    ) -> torch.Tensor:
        check_heads(query, key, value)
        if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
            raise BackendUnavailable(
                f"flash_attn_2 runs on CUDA in float16/bfloat16; got {query.dtype} on {query.device}. "
                "Choose kind='sdpa' for this device or dtype."
            )
        if mask.document_ids is None:
            out: torch.Tensor = self._module.flash_attn_func(query, key, value, softmax_scale=scale, causal=mask.causal)
            return out
        batch, seq, heads, dim = query.shape
        offsets, longest = mask.varlen_offsets()
        offsets = offsets.to(query.device)
        out = self._module.flash_attn_varlen_func(
            query.reshape(batch * seq, heads, dim),
            key.reshape(batch * seq, key.shape[2], dim),
            value.reshape(batch * seq, value.shape[2], dim),
            cu_seqlens_q=offsets,
            cu_seqlens_k=offsets,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=scale,
            causal=mask.causal,
        )
        return out.reshape(batch, seq, heads, dim)
