"""Grouped matmul behind one interface: eager reference, `torch._grouped_mm`, `grouped_gemm` (optional)."""

from d9d.kernels.grouped_mm.api import GroupedMm
from d9d.kernels.grouped_mm.config import (
    GROUPED_MM_CONFIG_ADAPTER,
    AnyGroupedMmConfig,
    EagerGroupedMmConfig,
    GroupedGemmConfig,
    TorchGroupedMmConfig,
    TritonGroupedMmConfig,
    build_grouped_mm,
    detect_grouped_mm_config,
    resolve_grouped_mm_config,
)
from d9d.kernels.grouped_mm.eager import EagerGroupedMm
from d9d.kernels.grouped_mm.grouped_gemm import GroupedGemm
from d9d.kernels.grouped_mm.torch_mm import TorchGroupedMm
from d9d.kernels.grouped_mm.triton import TritonGroupedMm

__all__ = [
    "GROUPED_MM_CONFIG_ADAPTER",
    "AnyGroupedMmConfig",
    "EagerGroupedMm",
    "EagerGroupedMmConfig",
    "GroupedGemm",
    "GroupedGemmConfig",
    "GroupedMm",
    "TorchGroupedMm",
    "TorchGroupedMmConfig",
    "TritonGroupedMm",
    "TritonGroupedMmConfig",
    "build_grouped_mm",
    "detect_grouped_mm_config",
    "resolve_grouped_mm_config",
]
