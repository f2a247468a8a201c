"""Rotary embedding of queries and keys: the interface, the eager reference and the backends.

Tables are `(batch, seq, rotary_dim)` cos and sin in the activation dtype (batch may be 1 and broadcast); only the
first `rotary_dim` channels of a head rotate. Styles: half (Llama, Qwen: channel `i` pairs with `i + rotary_dim/2`)
and interleaved (channels `2i`, `2i + 1`). The Triton kernel covers the half style; the interleaved style runs the
reference in every backend.
"""

from __future__ import annotations

from typing import Protocol

import torch

from d9d.kernels.triton_support import any_dtensor


class RopeKernel(Protocol):
    """`(rotate(q), rotate(k))`, differentiable in `q` and `k`."""

    name: str

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([-odd, even], dim=-1).flatten(-2)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """`x * cos + rotate(x) * sin` on the first `rotary_dim` channels of `(batch, seq, heads, head_dim)`."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    out = rotated * cos[:, :, None, :] + _rotate(rotated, interleaved) * sin[:, :, None, :]
    return out if passed.shape[-1] == 0 else torch.cat([out, passed], dim=-1)


def check_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.ndim != 4 or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"rope expects q (batch, seq, heads, head_dim) and k (batch, seq, kv_heads, head_dim); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}"
        )
    rotary_dim = cos.shape[-1]
    if cos.shape != sin.shape or rotary_dim % 2 or rotary_dim > q.shape[-1] or cos.shape[1] != q.shape[1]:
        raise ValueError(
            f"rope tables must be (batch, seq={q.shape[1]}, rotary_dim) with an even rotary_dim <= "
            f"head_dim={q.shape[-1]}; got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )


class EagerRope:
    name = "eager"

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_rope(q, k, cos, sin)
        return rope_reference(q, cos, sin, interleaved=interleaved), rope_reference(
            k, cos, sin, interleaved=interleaved
        )


class TritonRope:
    """q and k in one kernel (custom ops in `d9d.kernels.rope.ops`); imports Triton when built."""

    name = "triton"

    def __init__(self) -> None:
        from d9d.kernels.triton_support import import_triton

        import_triton()
        from d9d.kernels.rope import ops

        self._ops = ops

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_rope(q, k, cos, sin)
        if interleaved or any_dtensor(q, k, cos, sin):
            return EagerRope()(q, k, cos, sin, interleaved=interleaved)
        return self._ops.rope(q, k, cos, sin)
