"""The attention backend interface every implementation follows."""

from __future__ import annotations

from typing import Protocol

import torch

from d9d.kernels.attention.mask import AttentionMask


class AttentionBackend(Protocol):
    """Scaled dot-product attention with grouped key/value heads.

    Tensors are laid out `(batch, seq, heads, head_dim)`, the layout a projection produces: `query` has `H` heads,
    `key` and `value` have `H_kv` heads with `H_kv` dividing `H` (query head `h` uses key/value head
    `h // (H // H_kv)`). Returns `(batch, seq, H, head_dim)` in the query's dtype.
    """

    name: str

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: AttentionMask, scale: float
    ) -> torch.Tensor: ...


def check_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """The number of query heads per key/value head; raises on shapes that do not fit."""
    if query.ndim != 4 or key.shape != value.shape or key.ndim != 4:
        raise ValueError(
            "attention expects (batch, seq, heads, head_dim) tensors with key and value alike; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    heads, kv_heads = query.shape[2], key.shape[2]
    if heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads; H_kv must divide H")
    return heads // kv_heads
