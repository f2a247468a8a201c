"""Grouped matmul backend configs and `build_grouped_mm` (explicit > `D9D_BACKEND_AUTO_GROUPED_MM` > detection)."""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from d9d.kernels.capability import Capabilities
from d9d.kernels.grouped_mm.api import GroupedMm
from d9d.kernels.grouped_mm.eager import EagerGroupedMm
from d9d.kernels.grouped_mm.grouped_gemm import GroupedGemm
from d9d.kernels.grouped_mm.torch_mm import TorchGroupedMm
from d9d.kernels.grouped_mm.triton import TritonGroupedMm
from d9d.kernels.selection import resolve_backend_config

FAMILY = "grouped_mm"


class EagerGroupedMmConfig(BaseModel):
    """A loop of `F.linear` over the groups: any device, any dtype; the reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["eager"] = "eager"


class TorchGroupedMmConfig(BaseModel):
    """`torch._grouped_mm` (bf16 CUTLASS kernel on sm90+)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["torch"] = "torch"


class GroupedGemmConfig(BaseModel):
    """The `grouped_gemm` CUDA extension (optional extra `grouped-gemm`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["grouped_gemm"] = "grouped_gemm"


class TritonGroupedMmConfig(BaseModel):
    """The Triton grouped GEMM (optional extra `triton`): forward and both backward halves, no host sync."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["triton"] = "triton"


AnyGroupedMmConfig = Annotated[
    EagerGroupedMmConfig | TorchGroupedMmConfig | GroupedGemmConfig | TritonGroupedMmConfig,
    Field(discriminator="kind"),
]
GROUPED_MM_CONFIG_ADAPTER: TypeAdapter[AnyGroupedMmConfig] = TypeAdapter(AnyGroupedMmConfig)


def detect_grouped_mm_config(capabilities: Capabilities) -> AnyGroupedMmConfig:
    """`torch` on sm90+ GPUs, `grouped_gemm` on older GPUs where it is installed, else `eager` (CPUs included:
    `torch._grouped_mm` runs there but is no faster than the loop)."""
    if capabilities.cuda_at_least(9, 0):
        return TorchGroupedMmConfig()
    if capabilities.cuda_capability is not None and capabilities.has_package("grouped_gemm"):
        return GroupedGemmConfig()
    return EagerGroupedMmConfig()


def resolve_grouped_mm_config(
    config: AnyGroupedMmConfig | None = None, *, capabilities: Capabilities | None = None
) -> AnyGroupedMmConfig:
    return resolve_backend_config(
        FAMILY, config, GROUPED_MM_CONFIG_ADAPTER, detect_grouped_mm_config, capabilities=capabilities
    )


def build_grouped_mm(
    config: AnyGroupedMmConfig | None = None, *, capabilities: Capabilities | None = None
) -> GroupedMm:
    """The backend for `config`; `None` resolves it from the environment, then from the machine's capabilities.

    Raises:
        BackendUnavailable: the chosen backend's optional package is not installed.
    """
    resolved = resolve_grouped_mm_config(config, capabilities=capabilities)
    match resolved:
        case EagerGroupedMmConfig():
            return EagerGroupedMm()
        case TorchGroupedMmConfig():
            return TorchGroupedMm()
        case GroupedGemmConfig():
            return GroupedGemm()
        case TritonGroupedMmConfig():
            return TritonGroupedMm()
        case _:
            assert_never(resolved)
