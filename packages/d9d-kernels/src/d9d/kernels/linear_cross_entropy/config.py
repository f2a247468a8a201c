"""Fused linear + cross-entropy backend configs and `build_linear_cross_entropy`.

Precedence: explicit > `D9D_BACKEND_AUTO_LINEAR_CROSS_ENTROPY` > detection.
"""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from d9d.kernels.capability import Capabilities
from d9d.kernels.linear_cross_entropy.api import (
    EagerLinearCrossEntropy,
    LinearCrossEntropyKernel,
    TritonLinearCrossEntropy,
)
from d9d.kernels.selection import resolve_backend_config, triton_detected

FAMILY = "linear_cross_entropy"


class EagerLinearCrossEntropyConfig(BaseModel):
    """The chunked algorithm with PyTorch ops per chunk: any device and dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["eager"] = "eager"


class TritonLinearCrossEntropyConfig(BaseModel):
    """Triton per-chunk softmax statistics and gradient (optional extra `triton`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["triton"] = "triton"


AnyLinearCrossEntropyConfig = Annotated[
    EagerLinearCrossEntropyConfig | TritonLinearCrossEntropyConfig, Field(discriminator="kind")
]
LINEAR_CROSS_ENTROPY_CONFIG_ADAPTER: TypeAdapter[AnyLinearCrossEntropyConfig] = TypeAdapter(AnyLinearCrossEntropyConfig)


def detect_linear_cross_entropy_config(capabilities: Capabilities) -> AnyLinearCrossEntropyConfig:
    """`triton` on an sm90+ GPU with Triton installed, else `eager`."""
    return TritonLinearCrossEntropyConfig() if triton_detected(capabilities) else EagerLinearCrossEntropyConfig()


def resolve_linear_cross_entropy_config(
    config: AnyLinearCrossEntropyConfig | None = None, *, capabilities: Capabilities | None = None
) -> AnyLinearCrossEntropyConfig:
    return resolve_backend_config(
        FAMILY,
        config,
        LINEAR_CROSS_ENTROPY_CONFIG_ADAPTER,
        detect_linear_cross_entropy_config,
        capabilities=capabilities,
    )


def build_linear_cross_entropy(
    config: AnyLinearCrossEntropyConfig | None = None, *, capabilities: Capabilities | None = None
) -> LinearCrossEntropyKernel:
    """The backend for `config`; `None` resolves it from the environment, then from the machine's capabilities.

    Raises:
        BackendUnavailable: `triton` was chosen but Triton is not installed.
    """
    resolved = resolve_linear_cross_entropy_config(config, capabilities=capabilities)
    match resolved:
        case EagerLinearCrossEntropyConfig():
            return EagerLinearCrossEntropy()
        case TritonLinearCrossEntropyConfig():
            return TritonLinearCrossEntropy()
        case _:
            assert_never(resolved)
