"""SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.swiglu import EagerSwiGlu, SwiGluKernel
from d9d.models.blocks.late_init import init_normal_
from d9d.models.blocks.linear import DeferrableLinear


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.init_std = init_std
        self.gate_proj = DeferrableLinear(hidden_size, intermediate_size, bias=False)
        self.up_proj = DeferrableLinear(hidden_size, intermediate_size, bias=False)
        self.down_proj = DeferrableLinear(intermediate_size, hidden_size, bias=False)
        self.swiglu_kernel: SwiGluKernel = EagerSwiGlu()  # silu(gate) * up; a Triton kernel via apply_block_kernels

    def reset_parameters(self) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            init_normal_(linear.weight, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.swiglu_kernel(self.gate_proj(x), self.up_proj(x)))
        return out
