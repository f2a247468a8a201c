"""MoE permutation backend configs and `build_moe_permute` (explicit > `D9D_BACKEND_AUTO_MOE_PERMUTE` > detection)."""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from d9d.kernels.capability import Capabilities
from d9d.kernels.moe_permute.api import EagerMoePermute, MoePermuteKernel, TritonMoePermute
from d9d.kernels.selection import resolve_backend_config, triton_detected

FAMILY = "moe_permute"


class EagerMoePermuteConfig(BaseModel):
    """Plain PyTorch: any device and dtype; the reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["eager"] = "eager"


class TritonMoePermuteConfig(BaseModel):
    """Triton row gathers and fused combine (optional extra `triton`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["triton"] = "triton"


AnyMoePermuteConfig = Annotated[EagerMoePermuteConfig | TritonMoePermuteConfig, Field(discriminator="kind")]
MOE_PERMUTE_CONFIG_ADAPTER: TypeAdapter[AnyMoePermuteConfig] = TypeAdapter(AnyMoePermuteConfig)


def detect_moe_permute_config(capabilities: Capabilities) -> AnyMoePermuteConfig:
    """`triton` on an sm90+ GPU with Triton installed, else `eager`."""
    return TritonMoePermuteConfig() if triton_detected(capabilities) else EagerMoePermuteConfig()


def resolve_moe_permute_config(
    config: AnyMoePermuteConfig | None = None, *, capabilities: Capabilities | None = None
) -> AnyMoePermuteConfig:
    return resolve_backend_config(
        FAMILY, config, MOE_PERMUTE_CONFIG_ADAPTER, detect_moe_permute_config, capabilities=capabilities
    )


def build_moe_permute(
    config: AnyMoePermuteConfig | None = None, *, capabilities: Capabilities | None = None
) -> MoePermuteKernel:
    """The backend for `config`; `None` resolves it from the environment, then from the machine's capabilities.

    Raises:
        BackendUnavailable: `triton` was chosen but Triton is not installed.
    """
    resolved = resolve_moe_permute_config(config, capabilities=capabilities)
    match resolved:
        case EagerMoePermuteConfig():
            return EagerMoePermute()
        case TritonMoePermuteConfig():
            return TritonMoePermute()
        case _:
            assert_never(resolved)
