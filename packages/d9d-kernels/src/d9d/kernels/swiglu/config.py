"""SwiGLU backend configs and `build_swiglu` (explicit > `D9D_BACKEND_AUTO_SWIGLU` > detection)."""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from d9d.kernels.capability import Capabilities
from d9d.kernels.selection import resolve_backend_config, triton_detected
from d9d.kernels.swiglu.api import EagerSwiGlu, SwiGluKernel, TritonSwiGlu

FAMILY = "swiglu"


class EagerSwiGluConfig(BaseModel):
    """Plain PyTorch: any device and dtype; the reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["eager"] = "eager"


class TritonSwiGluConfig(BaseModel):
    """The fused Triton activation (optional extra `triton`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["triton"] = "triton"


AnySwiGluConfig = Annotated[EagerSwiGluConfig | TritonSwiGluConfig, Field(discriminator="kind")]
SWIGLU_CONFIG_ADAPTER: TypeAdapter[AnySwiGluConfig] = TypeAdapter(AnySwiGluConfig)


def detect_swiglu_config(capabilities: Capabilities) -> AnySwiGluConfig:
    """`triton` on an sm90+ GPU with Triton installed, else `eager`."""
    return TritonSwiGluConfig() if triton_detected(capabilities) else EagerSwiGluConfig()


def resolve_swiglu_config(
    config: AnySwiGluConfig | None = None, *, capabilities: Capabilities | None = None
) -> AnySwiGluConfig:
    return resolve_backend_config(
        FAMILY, config, SWIGLU_CONFIG_ADAPTER, detect_swiglu_config, capabilities=capabilities
    )


def build_swiglu(config: AnySwiGluConfig | None = None, *, capabilities: Capabilities | None = None) -> SwiGluKernel:
    """The backend for `config`; `None` resolves it from the environment, then from the machine's capabilities.

    Raises:
        BackendUnavailable: `triton` was chosen but Triton is not installed.
    """
    resolved = resolve_swiglu_config(config, capabilities=capabilities)
    match resolved:
        case EagerSwiGluConfig():
            return EagerSwiGlu()
        case TritonSwiGluConfig():
            return TritonSwiGlu()
        case _:
            assert_never(resolved)
