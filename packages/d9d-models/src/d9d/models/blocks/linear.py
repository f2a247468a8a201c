"""`DeferrableLinear`: the `nn.Linear` of the attention and FFN projections, whose weight gradient a pipeline's
split backward can defer to its weight pass.

An `nn.Linear` in every respect (state-dict keys, tensor-parallel plans, FSDP, LoRA's `isinstance` checks) whose
forward is d9d-kernels' `deferrable_linear`: plain `F.linear` except in the forwards a pipeline executor marks for
the weight-gradient store (design note 0024). Importing this module registers d9d-pipeline's store as d9d-kernels'
weight-gradient sink (kernels never import the pipeline).
"""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.deferrable_linear import deferrable_linear
from d9d.kernels.weight_gradient_sink import register_weight_gradient_sink
from d9d.pipeline.runtime.weight_store import PIPELINE_WEIGHT_GRADIENT_SINK

register_weight_gradient_sink(PIPELINE_WEIGHT_GRADIENT_SINK)


class DeferrableLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return deferrable_linear(input, self.weight, self.bias)
