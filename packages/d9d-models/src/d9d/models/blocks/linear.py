"""`DeferrableLinear`: the `nn.Linear` of the attention and FFN projections, whose weight gradient a pipeline's
split backward can defer to its weight pass.

An `nn.Linear` in every respect (state-dict keys, tensor-parallel plans, FSDP, LoRA's `isinstance` checks) whose
forward is d9d-kernels' `deferrable_linear`: plain `F.linear` except in the forwards a pipeline executor marks for
the weight-gradient store (design note 0024; `pipeline_split` registers the store with the kernels).
"""

from __future__ import annotations

import torch
from torch import nn

import d9d.models.blocks.pipeline_split  # noqa: F401 - registers the pipeline's weight-gradient sink
from d9d.kernels.deferrable_linear import deferrable_linear


class DeferrableLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return deferrable_linear(input, self.weight, self.bias)
