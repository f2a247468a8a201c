"""`torch._grouped_mm`: CUTLASS grouped GEMM on Hopper-class GPUs (bf16), a native kernel on CPU.

Strides must be multiples of 16 bytes (`K` and `M` multiples of 8 in bf16, 4 in fp32). On CPU its backward fails
for an expanded incoming gradient (e.g. from `out.sum()`); any real loss is fine, and CPU runs default to eager.
"""

from __future__ import annotations

import torch

from d9d.kernels.grouped_mm.api import check_grouped


class TorchGroupedMm:
    name = "torch"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        check_grouped(x, weight, group_sizes)
        offsets = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
        # mat_b is (E, K, M) with K contiguous: the transpose of the stacked nn.Linear weights, as the kernel wants.
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
