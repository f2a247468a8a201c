"""The Triton grouped GEMM backend (optional extra `triton`), imported on first use."""

from __future__ import annotations

import torch

from d9d.kernels.grouped_mm.api import check_grouped
from d9d.kernels.grouped_mm.eager import EagerGroupedMm
from d9d.kernels.triton_support import any_dtensor


class TritonGroupedMm:
    """Triton kernels for forward, input gradient and weight gradient (`d9d.kernels.grouped_mm.triton_ops`); the
    group sizes stay on the device."""

    name = "triton"

    def __init__(self) -> None:
        from d9d.kernels.triton_support import import_triton

        import_triton()
        from d9d.kernels.grouped_mm import triton_ops

        self._ops = triton_ops

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        check_grouped(x, weight, group_sizes)
        if any_dtensor(x, weight):
            return EagerGroupedMm()(x, weight, group_sizes)
        return self._ops.grouped_mm(x, weight, group_sizes)
