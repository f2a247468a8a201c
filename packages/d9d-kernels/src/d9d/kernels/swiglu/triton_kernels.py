# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernel bodies are untyped by design: pointers and constexpr block sizes.)
"""Triton SwiGLU, `silu(gate) * up`, elementwise in float32 with the eager reference's roundings."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.kernels.triton_support.tuning import autotune, size_class

_CONFIGS = [
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=16),
]


# Keyed on the size class of `n_elements`, not on it: under expert parallelism the rows of the grouped experts differ
# every step and layer, and an exact key re-ran the whole config benchmark on each (about 1 s per layer and step).
@autotune(_CONFIGS, key=["n_size_class"])
@triton.jit
def _forward_kernel(gate_ptr, up_ptr, out_ptr, n_elements, n_size_class, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(gate_ptr.dtype.element_ty).to(tl.float32)  # eager rounds silu's output
    tl.store(out_ptr + offsets, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@autotune(_CONFIGS, key=["n_size_class"])
@triton.jit
def _backward_kernel(
    grad_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, n_elements, n_size_class, BLOCK: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    # d silu / d gate = sigmoid * (1 + gate * (1 - sigmoid))
    grad_gate = grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(grad_gate_ptr + offsets, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offsets, (grad * silu).to(grad_up_ptr.dtype.element_ty), mask=mask)


def _grid(n_elements: int) -> object:
    return lambda meta: (triton.cdiv(n_elements, meta["BLOCK"]),)


def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    if gate.numel():
        n = gate.numel()
        _forward_kernel[_grid(n)](gate, up, out, n, size_class(n))
    return out


def backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        n = gate.numel()
        _backward_kernel[_grid(n)](grad, gate, up, grad_gate, grad_up, n, size_class(n))
    return grad_gate, grad_up
