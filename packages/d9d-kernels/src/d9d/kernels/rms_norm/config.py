"""RMSNorm backend configs and `build_rms_norm` (explicit > `D9D_BACKEND_AUTO_RMS_NORM` > detection)."""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from d9d.kernels.capability import Capabilities
from d9d.kernels.rms_norm.api import EagerRmsNorm, RmsNormKernel, TritonRmsNorm
from d9d.kernels.selection import resolve_backend_config, triton_detected

FAMILY = "rms_norm"


class EagerRmsNormConfig(BaseModel):
    """Plain PyTorch: any device and dtype; the reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["eager"] = "eager"


class TritonRmsNormConfig(BaseModel):
    """The Triton kernel with the fused residual add (optional extra `triton`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["triton"] = "triton"


AnyRmsNormConfig = Annotated[EagerRmsNormConfig | TritonRmsNormConfig, Field(discriminator="kind")]
RMS_NORM_CONFIG_ADAPTER: TypeAdapter[AnyRmsNormConfig] = TypeAdapter(AnyRmsNormConfig)


def detect_rms_norm_config(capabilities: Capabilities) -> AnyRmsNormConfig:
    """`triton` on an sm90+ GPU with Triton installed, else `eager`."""
    return TritonRmsNormConfig() if triton_detected(capabilities) else EagerRmsNormConfig()


def resolve_rms_norm_config(
    config: AnyRmsNormConfig | None = None, *, capabilities: Capabilities | None = None
) -> AnyRmsNormConfig:
    return resolve_backend_config(
        FAMILY, config, RMS_NORM_CONFIG_ADAPTER, detect_rms_norm_config, capabilities=capabilities
    )


def build_rms_norm(
    config: AnyRmsNormConfig | None = None, *, capabilities: Capabilities | None = None
) -> RmsNormKernel:
    """The backend for `config`; `None` resolves it from the environment, then from the machine's capabilities.

    Raises:
        BackendUnavailable: `triton` was chosen but Triton is not installed.
    """
    resolved = resolve_rms_norm_config(config, capabilities=capabilities)
    match resolved:
        case EagerRmsNormConfig():
            return EagerRmsNorm()
        case TritonRmsNormConfig():
            return TritonRmsNorm()
        case _:
            assert_never(resolved)
