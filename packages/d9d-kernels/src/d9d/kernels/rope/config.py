"""RoPE backend configs and `build_rope` (explicit > `D9D_BACKEND_AUTO_ROPE` > detection)."""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from d9d.kernels.capability import Capabilities
from d9d.kernels.rope.api import EagerRope, RopeKernel, TritonRope
from d9d.kernels.selection import resolve_backend_config, triton_detected

FAMILY = "rope"


class EagerRopeConfig(BaseModel):
    """Plain PyTorch: any device and dtype; the reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["eager"] = "eager"


class TritonRopeConfig(BaseModel):
    """q and k rotated by one Triton kernel (optional extra `triton`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["triton"] = "triton"


AnyRopeConfig = Annotated[EagerRopeConfig | TritonRopeConfig, Field(discriminator="kind")]
ROPE_CONFIG_ADAPTER: TypeAdapter[AnyRopeConfig] = TypeAdapter(AnyRopeConfig)


def detect_rope_config(capabilities: Capabilities) -> AnyRopeConfig:
    """`triton` on an sm90+ GPU with Triton installed, else `eager`."""
    return TritonRopeConfig() if triton_detected(capabilities) else EagerRopeConfig()


def resolve_rope_config(
    config: AnyRopeConfig | None = None, *, capabilities: Capabilities | None = None
) -> AnyRopeConfig:
    return resolve_backend_config(FAMILY, config, ROPE_CONFIG_ADAPTER, detect_rope_config, capabilities=capabilities)


def build_rope(config: AnyRopeConfig | None = None, *, capabilities: Capabilities | None = None) -> RopeKernel:
    """The backend for `config`; `None` resolves it from the environment, then from the machine's capabilities.

    Raises:
        BackendUnavailable: `triton` was chosen but Triton is not installed.
    """
    resolved = resolve_rope_config(config, capabilities=capabilities)
    match resolved:
        case EagerRopeConfig():
            return EagerRope()
        case TritonRopeConfig():
            return TritonRope()
        case _:
            assert_never(resolved)
