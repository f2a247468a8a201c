"""Rotary embedding of q and k together: eager reference and a Triton kernel (custom ops)."""

from d9d.kernels.rope.api import EagerRope, RopeKernel, TritonRope, rope_reference
from d9d.kernels.rope.config import (
    ROPE_CONFIG_ADAPTER,
    AnyRopeConfig,
    EagerRopeConfig,
    TritonRopeConfig,
    build_rope,
    detect_rope_config,
    resolve_rope_config,
)

__all__ = [
    "ROPE_CONFIG_ADAPTER",
    "AnyRopeConfig",
    "EagerRope",
    "EagerRopeConfig",
    "RopeKernel",
    "TritonRope",
    "TritonRopeConfig",
    "build_rope",
    "detect_rope_config",
    "resolve_rope_config",
    "rope_reference",
]
