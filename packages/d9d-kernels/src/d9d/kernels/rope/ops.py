"""Rotary embedding of q and k together as torch custom ops with fake implementations, and its autograd.

`d9d_kernels::rope_forward` and `d9d_kernels::rope_backward_input` (the tables are constants, there is no weight,
so the whole backward is the input-gradient half).
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.kernels.rope import triton_kernels
from d9d.kernels.triton_support import check_triton_device, kernel_op


@kernel_op("d9d_kernels::rope_forward")
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_triton_device(q, k, cos, sin)
    return triton_kernels.rotate(q, k, cos, sin, backward=False)


@_forward_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


@kernel_op("d9d_kernels::rope_backward_input")
def _backward_op(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_triton_device(grad_q, grad_k, cos, sin)
    return triton_kernels.rotate(grad_q, grad_k, cos, sin, backward=True)


@_backward_op.register_fake
def _(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(grad_q), torch.empty_like(grad_k)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()


def _tables(table: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`(batch, seq, rotary_dim)` (batch may be broadcast) as contiguous `(tokens, rotary_dim)`."""
    return table.expand(*like.shape[:2], table.shape[-1]).reshape(-1, table.shape[-1]).contiguous()


def rope_backward_input(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of q and k `(batch, seq, heads, head_dim)` for the tables `(batch, seq, rotary_dim)`."""
    got_q, got_k = _backward_op(_flat(grad_q), _flat(grad_k), _tables(cos, grad_q), _tables(sin, grad_q))
    return got_q.view(grad_q.shape), got_k.view(grad_k.shape)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat_cos, flat_sin = _tables(cos, q), _tables(sin, q)
        ctx.save_for_backward(flat_cos, flat_sin)
        ctx.shapes = (q.shape, k.shape)
        ctx.set_materialize_grads(False)  # backward makes the zeros of a missing gradient itself
        q_out, k_out = _forward_op(_flat(q), _flat(k), flat_cos, flat_sin)
        return q_out.view(q.shape), k_out.view(k.shape)

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        flat_cos, flat_sin = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        grad_q = grad_q if grad_q is not None else flat_cos.new_zeros(q_shape)
        grad_k = grad_k if grad_k is not None else flat_cos.new_zeros(k_shape)
        got_q, got_k = _backward_op(_flat(grad_q), _flat(grad_k), flat_cos, flat_sin)
        return got_q.view(q_shape), got_k.view(k_shape), None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q` and `k` `(batch, seq, heads, head_dim)` by half-style tables `(batch, seq, rotary_dim)`."""
    out = _RopeFunction.apply(q, k, cos, sin)  # type: ignore[no-untyped-call]
    return out[0], out[1]
