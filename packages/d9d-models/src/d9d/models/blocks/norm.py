"""RMSNorm, computed in float32 and scaled in the input dtype (as Hugging Face's Qwen3/Llama)."""

from __future__ import annotations

import torch
from torch import nn

from d9d.models.blocks.late_init import init_ones_


class RMSNorm(nn.Module):
    def __init__(self, size: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))

    def reset_parameters(self) -> None:
        init_ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
