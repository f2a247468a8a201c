"""FlexAttention (`torch.nn.attention.flex_attention`): causal and document masks as a block-sparse mask.

The mask is a `mask_mod` (causal, and same document when `document_ids` is given) turned into a `BlockMask` once per
forward pass and cached on the `AttentionMask`, so every layer shares it and fully masked blocks (other documents,
the future) are skipped rather than computed. Grouped key/value heads are native (`enable_gqa`). On CUDA the
attention runs through `torch.compile(flex_attention)` (the eager function is a slow reference); on other devices
the eager function runs for inference, which is what the CPU tests compare with the eager backend. PyTorch's
FlexAttention has no CPU backward, so on other devices inputs that need gradients go to SDPA with the same mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from d9d.kernels.attention.api import check_heads
from d9d.kernels.attention.mask import AttentionMask
from d9d.kernels.attention.sdpa import SdpaAttention

_COMPILED: list[Callable[..., Any]] = []


def _flex_attention(device: torch.device) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]


def block_mask_for(mask: AttentionMask, batch: int, seq_len: int, device: torch.device) -> Any:
    """The `BlockMask` of `mask` for `(batch, seq_len)` on `device`, cached on `mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    def build() -> Any:
        causal, documents = mask.causal, mask.document_ids
        if documents is not None:
            ids = documents.to(device)
            if ids.shape[-1] != seq_len:
                raise ValueError(
                    f"document_ids has sequence length {ids.shape[-1]} but attention runs over {seq_len} positions"
                )

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                same = ids[b, q_idx] == ids[b, kv_idx]
                return same & (q_idx >= kv_idx) if causal else same

            return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=device)

        def causal_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx >= kv_idx

        return create_block_mask(causal_mod, None, None, seq_len, seq_len, device=device)

    return mask.derived(f"flex:{batch}:{seq_len}:{device}", build)


# Built once per forward pass and run eagerly even inside a compiled layer (a graph break, not a retrace per mask).
_eager_block_mask_for: Callable[[AttentionMask, int, int, torch.device], Any] = torch.compiler.disable(  # type: ignore[no-untyped-call]  # untyped in torch
    block_mask_for
)


class FlexAttention:
    name = "flex"

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: AttentionMask, scale: float
    ) -> torch.Tensor:
        groups = check_heads(query, key, value)
        if query.device.type != "cuda" and torch.is_grad_enabled() and _needs_grad(query, key, value):
            return SdpaAttention()(query, key, value, mask=mask, scale=scale)  # no FlexAttention backward here
        batch, seq_len = query.shape[0], query.shape[1]
        q, k, v = (tensor.transpose(1, 2) for tensor in (query, key, value))
        if not mask.causal and mask.document_ids is None:
            block_mask = None
        else:
            block_mask = _eager_block_mask_for(mask, batch, seq_len, query.device)
        out = _flex_attention(query.device)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=groups > 1)
        assert isinstance(out, torch.Tensor)
        return out.transpose(1, 2)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return any(tensor.requires_grad for tensor in tensors)
