"""The `grouped_gemm` CUDA extension (optional extra `grouped-gemm`), imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from d9d.kernels.errors import BackendUnavailable
from d9d.kernels.grouped_mm.api import check_grouped


def import_grouped_gemm_ops() -> Any:
    try:
        ops = importlib.import_module("grouped_gemm.ops")
    except ImportError as error:
        raise BackendUnavailable(
            f"the grouped matmul backend 'grouped_gemm' needs the grouped_gemm package, which is not importable "
            f"({error}); install it with `pip install d9d-kernels[grouped-gemm]` (CUDA only), or choose kind='torch' "
            "or kind='eager'"
        ) from error
    return ops


class GroupedGemm:
    name = "grouped_gemm"

    def __init__(self) -> None:
        self._ops = import_grouped_gemm_ops()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        check_grouped(x, weight, group_sizes)
        # The extension wants the group sizes as an int64 CPU tensor, and weight (E, M, K) with trans_b.
        sizes = group_sizes.to(device="cpu", dtype=torch.int64)
        total = int(sizes.sum())
        if total == x.shape[0]:
            out: torch.Tensor = self._ops.gmm(x, weight, sizes, trans_b=True)
            return out
        # Padding rows past the groups (GroupedMm): the extension wants every row in a group; they get zeros.
        valid: torch.Tensor = self._ops.gmm(x[:total], weight, sizes, trans_b=True)
        return torch.cat([valid, valid.new_zeros(x.shape[0] - total, valid.shape[1])])
