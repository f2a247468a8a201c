"""Attention backend configs and `build_attention_backend` (explicit > `D9D_BACKEND_AUTO_ATTENTION` > detection)."""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from d9d.kernels.attention.api import AttentionBackend
from d9d.kernels.attention.cudnn import CudnnAttention
from d9d.kernels.attention.eager import EagerAttention
from d9d.kernels.attention.flash import FlashAttention2
from d9d.kernels.attention.flex import FlexAttention
from d9d.kernels.attention.sdpa import SdpaAttention
from d9d.kernels.capability import Capabilities
from d9d.kernels.selection import resolve_backend_config

FAMILY = "attention"


class EagerAttentionConfig(BaseModel):
    """Explicit scores and a float32 softmax: the reference every other backend is tested against."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["eager"] = "eager"


class SdpaAttentionConfig(BaseModel):
    """`torch.nn.functional.scaled_dot_product_attention` (its flash/cuDNN kernels are the GPU fast path)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["sdpa"] = "sdpa"


class FlashAttention2Config(BaseModel):
    """The `flash_attn` package (optional extra `flash-attn`); variable-length kernel for packed documents."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["flash_attn_2"] = "flash_attn_2"


class CudnnAttentionConfig(BaseModel):
    """SDPA restricted to its cuDNN kernel (CUDA only): fails rather than falling back to another kernel."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["cudnn"] = "cudnn"


class FlexAttentionConfig(BaseModel):
    """FlexAttention with causal/document block masks (compiled on CUDA; the eager function elsewhere)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["flex"] = "flex"


AnyAttentionConfig = Annotated[
    EagerAttentionConfig | SdpaAttentionConfig | FlashAttention2Config | CudnnAttentionConfig | FlexAttentionConfig,
    Field(discriminator="kind"),
]
ATTENTION_CONFIG_ADAPTER: TypeAdapter[AnyAttentionConfig] = TypeAdapter(AnyAttentionConfig)


def detect_attention_config(capabilities: Capabilities) -> AnyAttentionConfig:
    """SDPA everywhere: it picks flash or cuDNN kernels on GPUs itself and accepts every dtype and mask.

    FlashAttention is never chosen automatically, because it rejects float32 and non-CUDA tensors; ask for it.
    """
    del capabilities
    return SdpaAttentionConfig()


def resolve_attention_config(
    config: AnyAttentionConfig | None = None, *, capabilities: Capabilities | None = None
) -> AnyAttentionConfig:
    return resolve_backend_config(
        FAMILY, config, ATTENTION_CONFIG_ADAPTER, detect_attention_config, capabilities=capabilities
    )


def build_attention_backend(
    config: AnyAttentionConfig | None = None, *, capabilities: Capabilities | None = None
) -> AttentionBackend:
    """The backend for `config`; `None` resolves it from the environment, then from the machine's capabilities.

    Raises:
        BackendUnavailable: the chosen backend's optional package is not installed.
    """
    resolved = resolve_attention_config(config, capabilities=capabilities)
    match resolved:
        case EagerAttentionConfig():
            return EagerAttention()
        case SdpaAttentionConfig():
            return SdpaAttention()
        case FlashAttention2Config():
            return FlashAttention2()
        case CudnnAttentionConfig():
            return CudnnAttention()
        case FlexAttentionConfig():
            return FlexAttention()
        case _:
            assert_never(resolved)
