"""Mixed precision shared by every data-parallel style: compute dtype for parameters, dtype for gradient reduction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Parameters are kept in their own (master) dtype and cast to `param_dtype` for forward and backward.

    `reduce_dtype` is the dtype gradients are accumulated and reduced in (e.g. float32 for bfloat16 compute); `None`
    keeps the parameter's dtype. The same policy means the same numerics under replicate, FSDP and HSDP.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def to_fsdp(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


BF16_COMPUTE_FP32_REDUCE = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
