"""Expert-dispatch backend configs and `build_token_dispatcher` (explicit > `D9D_BACKEND_AUTO_EXPERT_DISPATCH` >
detection)."""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from d9d.kernels.capability import Capabilities, detect_capabilities
from d9d.kernels.expert_dispatch.all_to_all import AllToAllDispatcher
from d9d.kernels.expert_dispatch.api import TokenDispatcher
from d9d.kernels.expert_dispatch.capacity import DEFAULT_CAPACITY_FACTOR, AllToAllCapacityDispatcher
from d9d.kernels.expert_dispatch.capacity_tokens import (
    DEFAULT_COPY_CAPACITY_FACTOR,
    DEFAULT_TOKEN_CAPACITY_FACTOR,
    AllToAllTokenCapacityDispatcher,
)
from d9d.kernels.expert_dispatch.deep_ep import DeepEpDispatcher
from d9d.kernels.selection import resolve_backend_config

FAMILY = "expert_dispatch"


class AllToAllDispatchConfig(BaseModel):
    """`all_to_all_single` with exchanged per-expert counts: any device and backend (gloo, NCCL); the reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["all_to_all"] = "all_to_all"


class AllToAllCapacityDispatchConfig(BaseModel):
    """`all_to_all_single` with a fixed capacity per (source, destination) rank pair: no host sync, so the GPU
    queue never drains at an MoE layer; copies beyond the capacity are dropped (design 0029). Any device and
    backend; every rank of the group must dispatch the same number of tokens. Never picked by detection (it can
    drop copies): ask for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["all_to_all_capacity"] = "all_to_all_capacity"
    capacity_factor: float = Field(
        default=DEFAULT_CAPACITY_FACTOR,
        gt=0,
        allow_inf_nan=False,
        description="rows each rank sends each rank, over the mean T * k / ep (rounded up to 16); 2.0 covers the "
        "anchor's measured busiest rank (1.59x the mean) with margin",
    )


class AllToAllTokensDispatchConfig(BaseModel):
    """Like `all_to_all_capacity` (static shapes, no host sync), but each token travels once to each rank that owns
    one of its experts and comes back as one row, its local experts' outputs already weighted and summed (design
    0031): at top-8 over 4 ranks, half the padded copies' exchange volume, and nothing is dropped on the way at the
    default `token_capacity_factor`. Never picked by detection (the expert rows per rank have a capacity): ask for
    it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["all_to_all_tokens"] = "all_to_all_tokens"
    token_capacity_factor: float = Field(
        default=DEFAULT_TOKEN_CAPACITY_FACTOR,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="token rows each rank sends each rank, over the tokens T (rounded up to 16); 1.0 never drops",
    )
    copy_capacity_factor: float = Field(
        default=DEFAULT_COPY_CAPACITY_FACTOR,
        gt=0,
        allow_inf_nan=False,
        description="expert input rows per rank, over the mean T * k (rounded up to 16); ep never drops, 2.0 covers "
        "the anchor's busiest rank (1.6x the mean)",
    )


class DeepEpDispatchConfig(BaseModel):
    """DeepEP (optional extra `deep-ep`, Hopper GPUs, NCCL group within one NVLink host for `normal` mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["deep_ep"] = "deep_ep"
    mode: Literal["normal", "low_latency"] = Field(
        default="normal", description="normal: training (high throughput); low_latency: inference, needs NVSHMEM"
    )
    num_nvl_bytes: int = Field(default=1_000_000_000, gt=0, description="NVLink buffer size of normal mode")
    num_sms: int = Field(default=24, gt=0, multiple_of=2, description="SMs DeepEP's normal-mode kernels use")
    max_dispatch_tokens_per_rank: int = Field(default=128, gt=0, description="low-latency mode's per-rank limit")


AnyExpertDispatchConfig = Annotated[
    AllToAllDispatchConfig | AllToAllCapacityDispatchConfig | AllToAllTokensDispatchConfig | DeepEpDispatchConfig,
    Field(discriminator="kind"),
]
EXPERT_DISPATCH_CONFIG_ADAPTER: TypeAdapter[AnyExpertDispatchConfig] = TypeAdapter(AnyExpertDispatchConfig)


def detect_expert_dispatch_config(capabilities: Capabilities) -> AnyExpertDispatchConfig:
    """`deep_ep` on sm90+ GPUs where it is installed, else `all_to_all`."""
    if capabilities.cuda_at_least(9, 0) and capabilities.has_package("deep_ep"):
        return DeepEpDispatchConfig()
    return AllToAllDispatchConfig()


def capabilities_of_group(group: dist.ProcessGroup) -> Capabilities:
    """The machine's capabilities as this group sees them: a gloo group moves CPU tensors whatever GPUs exist."""
    if dist.get_backend(group) == "nccl":
        return detect_capabilities()
    return detect_capabilities("cpu")


def resolve_expert_dispatch_config(
    config: AnyExpertDispatchConfig | None = None, *, capabilities: Capabilities | None = None
) -> AnyExpertDispatchConfig:
    return resolve_backend_config(
        FAMILY, config, EXPERT_DISPATCH_CONFIG_ADAPTER, detect_expert_dispatch_config, capabilities=capabilities
    )


def build_token_dispatcher(
    config: AnyExpertDispatchConfig | None,
    *,
    group: dist.ProcessGroup,
    num_experts: int,
    capabilities: Capabilities | None = None,
) -> TokenDispatcher:
    """The dispatcher for `config` over the expert-parallel `group`; `None` resolves it from the environment,
    then from what the group can use (`capabilities_of_group`).

    Raises:
        BackendUnavailable: `deep_ep` was chosen and is not installed.
        ValueError: `num_experts` does not split evenly over the group.
    """
    capabilities = capabilities if capabilities is not None else capabilities_of_group(group)
    resolved = resolve_expert_dispatch_config(config, capabilities=capabilities)
    match resolved:
        case AllToAllDispatchConfig():
            return AllToAllDispatcher(group, num_experts)
        case AllToAllCapacityDispatchConfig():
            return AllToAllCapacityDispatcher(group, num_experts, resolved.capacity_factor)
        case AllToAllTokensDispatchConfig():
            return AllToAllTokenCapacityDispatcher(
                group, num_experts, resolved.token_capacity_factor, resolved.copy_capacity_factor
            )
        case DeepEpDispatchConfig():
            return DeepEpDispatcher(
                group,
                num_experts,
                mode=resolved.mode,
                num_nvl_bytes=resolved.num_nvl_bytes,
                num_sms=resolved.num_sms,
                max_dispatch_tokens_per_rank=resolved.max_dispatch_tokens_per_rank,
            )
        case _:
            assert_never(resolved)
