"""SwiGLU activation, `silu(gate) * up`: eager reference and a Triton kernel (custom ops)."""

from d9d.kernels.swiglu.api import EagerSwiGlu, SwiGluKernel, TritonSwiGlu, swiglu_reference
from d9d.kernels.swiglu.config import (
    SWIGLU_CONFIG_ADAPTER,
    AnySwiGluConfig,
    EagerSwiGluConfig,
    TritonSwiGluConfig,
    build_swiglu,
    detect_swiglu_config,
    resolve_swiglu_config,
)

__all__ = [
    "SWIGLU_CONFIG_ADAPTER",
    "AnySwiGluConfig",
    "EagerSwiGlu",
    "EagerSwiGluConfig",
    "SwiGluKernel",
    "TritonSwiGlu",
    "TritonSwiGluConfig",
    "build_swiglu",
    "detect_swiglu_config",
    "resolve_swiglu_config",
    "swiglu_reference",
]
