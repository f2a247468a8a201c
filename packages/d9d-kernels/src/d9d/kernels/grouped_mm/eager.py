"""The eager reference: a Python loop of `functional.linear` over the groups. Runs on any device and dtype; padding
rows past the groups get zero outputs.

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
        total = sum(sizes)
        if total > x.shape[0]:
            raise ValueError(
                f"group sizes sum to {total} but x has only {x.shape[0]} rows (they must sum to at most the row "
                "count; rows past the sum are padding)"
            )
        parts = [functional.linear(rows, weight[group]) for group, rows in enumerate(torch.split(x[:total], sizes))]
        if total < x.shape[0]:  # padding rows: zero outputs (and so zero input gradients)
            parts.append(x.new_zeros(x.shape[0] - total, weight.shape[1]))
        return torch.cat(parts) if parts else x.new_empty(0, weight.shape[1])
