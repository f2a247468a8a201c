"""The eager reference: a Python loop of `functional.linear` over the groups. Runs on any device and dtype.

The loop needs the group sizes on the host, so it never runs under Dynamo (`eager_only`): traced, each routing's sizes
would become guards and every step would recompile the compiled layer around it (`compile_layers` on CPU).
"""

from __future__ import annotations

import torch
from torch.nn import functional

from d9d.kernels.eager_only import eager_only
from d9d.kernels.grouped_mm.api import check_grouped


class EagerGroupedMm:
    name = "eager"

    @eager_only
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        check_grouped(x, weight, group_sizes)
        sizes = [int(size) for size in group_sizes.tolist()]
        if sum(sizes) != x.shape[0]:
            raise ValueError(f"group sizes sum to {sum(sizes)} but x has {x.shape[0]} rows")
        parts = [functional.linear(rows, weight[group]) for group, rows in enumerate(torch.split(x, sizes))]
        return torch.cat(parts) if parts else x.new_empty(0, weight.shape[1])
