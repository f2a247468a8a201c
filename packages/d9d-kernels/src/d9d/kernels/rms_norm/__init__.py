"""RMSNorm with a fused residual add: eager reference and Triton kernels (custom ops, split backward)."""

from d9d.kernels.rms_norm.api import EagerRmsNorm, RmsNormKernel, TritonRmsNorm
from d9d.kernels.rms_norm.config import (
    RMS_NORM_CONFIG_ADAPTER,
    AnyRmsNormConfig,
    EagerRmsNormConfig,
    TritonRmsNormConfig,
    build_rms_norm,
    detect_rms_norm_config,
    resolve_rms_norm_config,
)
from d9d.kernels.rms_norm.reference import rms_norm_reference

__all__ = [
    "RMS_NORM_CONFIG_ADAPTER",
    "AnyRmsNormConfig",
    "EagerRmsNorm",
    "EagerRmsNormConfig",
    "RmsNormKernel",
    "TritonRmsNorm",
    "TritonRmsNormConfig",
    "build_rms_norm",
    "detect_rms_norm_config",
    "resolve_rms_norm_config",
    "rms_norm_reference",
]
