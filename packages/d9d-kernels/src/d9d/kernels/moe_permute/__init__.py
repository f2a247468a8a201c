"""MoE token permutation by expert and back (with the combine weights): eager reference and Triton kernels."""

from d9d.kernels.moe_permute.api import EagerMoePermute, MoePermuteKernel, TritonMoePermute, sort_by_expert
from d9d.kernels.moe_permute.config import (
    MOE_PERMUTE_CONFIG_ADAPTER,
    AnyMoePermuteConfig,
    EagerMoePermuteConfig,
    TritonMoePermuteConfig,
    build_moe_permute,
    detect_moe_permute_config,
    resolve_moe_permute_config,
)

__all__ = [
    "MOE_PERMUTE_CONFIG_ADAPTER",
    "AnyMoePermuteConfig",
    "EagerMoePermute",
    "EagerMoePermuteConfig",
    "MoePermuteKernel",
    "TritonMoePermute",
    "TritonMoePermuteConfig",
    "build_moe_permute",
    "detect_moe_permute_config",
    "resolve_moe_permute_config",
    "sort_by_expert",
]
