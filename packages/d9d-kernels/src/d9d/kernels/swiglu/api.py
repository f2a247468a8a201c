"""The SwiGLU activation interface (`silu(gate) * up`) and its backends."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn import functional

from d9d.kernels.triton_support import any_dtensor


class SwiGluKernel(Protocol):
    """`silu(gate) * up`, differentiable in both."""

    name: str

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The eager reference: two PyTorch ops, each rounding to the input dtype."""
    return functional.silu(gate) * up


class EagerSwiGlu:
    name = "eager"

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_reference(gate, up)


class TritonSwiGlu:
    """One fused kernel forward, one backward (custom ops in `d9d.kernels.swiglu.ops`); imports Triton when built."""

    name = "triton"

    def __init__(self) -> None:
        from d9d.kernels.triton_support import import_triton

        import_triton()
        from d9d.kernels.swiglu import ops

        self._ops = ops

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if any_dtensor(gate, up):
            return swiglu_reference(gate, up)
        return self._ops.swiglu(gate, up)
