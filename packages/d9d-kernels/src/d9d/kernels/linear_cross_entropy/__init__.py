"""Fused linear + cross-entropy that never holds the full logits, with per-shard pieces for a vocabulary-parallel
head (`LogitStats`, `combine_logit_stats`, `logit_stats` / `logit_gradients`). `kernel.summed(...)` is the loss
reduced by a sum with its gradients computed in forward (`SummedLoss`; design note 0023)."""

from d9d.kernels.linear_cross_entropy.accumulate import addmm_float32_
from d9d.kernels.linear_cross_entropy.api import (
    EagerLinearCrossEntropy,
    LinearCrossEntropyKernel,
    TritonLinearCrossEntropy,
)
from d9d.kernels.linear_cross_entropy.chunks import (
    IGNORE_INDEX,
    LogitStats,
    combine_logit_stats,
    logit_gradients,
    logit_stats,
    logit_stats_and_gradients,
    losses_from_stats,
)
from d9d.kernels.linear_cross_entropy.config import (
    LINEAR_CROSS_ENTROPY_CONFIG_ADAPTER,
    AnyLinearCrossEntropyConfig,
    EagerLinearCrossEntropyConfig,
    TritonLinearCrossEntropyConfig,
    build_linear_cross_entropy,
    detect_linear_cross_entropy_config,
    resolve_linear_cross_entropy_config,
)
from d9d.kernels.linear_cross_entropy.reference import TorchChunkMath, linear_cross_entropy_reference
from d9d.kernels.linear_cross_entropy.summed import SummedLoss

__all__ = [
    "IGNORE_INDEX",
    "LINEAR_CROSS_ENTROPY_CONFIG_ADAPTER",
    "AnyLinearCrossEntropyConfig",
    "EagerLinearCrossEntropy",
    "EagerLinearCrossEntropyConfig",
    "LinearCrossEntropyKernel",
    "LogitStats",
    "SummedLoss",
    "TorchChunkMath",
    "TritonLinearCrossEntropy",
    "TritonLinearCrossEntropyConfig",
    "addmm_float32_",
    "build_linear_cross_entropy",
    "combine_logit_stats",
    "detect_linear_cross_entropy_config",
    "linear_cross_entropy_reference",
    "logit_gradients",
    "logit_stats",
    "logit_stats_and_gradients",
    "losses_from_stats",
    "resolve_linear_cross_entropy_config",
]
