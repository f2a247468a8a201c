"""RMSNorm, computed in float32 and scaled in the input dtype (as Hugging Face's Qwen3/Llama).

The arithmetic is a `d9d.kernels.rms_norm` backend (`rms_norm_kernel`, eager by default; `apply_block_kernels` swaps
it), which also offers the residual add fused into the norm (`add_and_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.rms_norm import EagerRmsNorm, RmsNormKernel
from d9d.models.blocks.late_init import init_ones_


class RMSNorm(nn.Module):
    def __init__(self, size: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))
        self.rms_norm_kernel: RmsNormKernel = EagerRmsNorm()

    def reset_parameters(self) -> None:
        init_ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed, _ = self.rms_norm_kernel(x, self.weight, eps=self.eps)
        return normed

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: the residual stream's update and its norm in one kernel."""
        return self.rms_norm_kernel(x, self.weight, eps=self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
