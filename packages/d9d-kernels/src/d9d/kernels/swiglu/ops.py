"""SwiGLU as torch custom ops with fake implementations, and its autograd composition.

`d9d_kernels::swiglu_forward` and `d9d_kernels::swiglu_backward_input`. The activation has no weights, so its whole
backward is the input-gradient half: a pipeline schedule's weight-gradient half of a SwiGLU block is only the
linear layers around it (`swiglu_backward_input` is the split piece to call).
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.kernels.swiglu import triton_kernels
from d9d.kernels.triton_support import check_triton_device, kernel_op


@kernel_op("d9d_kernels::swiglu_forward")
def _forward_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_triton_device(gate, up)
    return triton_kernels.forward(gate, up)


@_forward_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate)


@kernel_op("d9d_kernels::swiglu_backward_input")
def _backward_op(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_triton_device(grad, gate, up)
    return triton_kernels.backward(grad, gate, up)


@_backward_op.register_fake
def _(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def swiglu_backward_input(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(grad_gate, grad_up)` of `silu(gate) * up` for the incoming `grad`."""
    grad_gate, grad_up = _backward_op(grad.contiguous(), gate.contiguous(), up.contiguous())
    return grad_gate.view(gate.shape), grad_up.view(up.shape)


class _SwiGluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        out: torch.Tensor = _forward_op(gate, up)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return swiglu_backward_input(grad, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` by the Triton kernel; numerically as the eager `functional.silu(gate) * up`."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must have one shape and dtype, got {tuple(gate.shape)} {gate.dtype} and "
            f"{tuple(up.shape)} {up.dtype}"
        )
    out = _SwiGluFunction.apply(gate, up)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out
