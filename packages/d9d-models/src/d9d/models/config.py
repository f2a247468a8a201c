"""`DecoderConfig`: how a model runs (kernels, checkpointing, loss chunking), as opposed to its `*Parameters`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.kernels.attention import AnyAttentionConfig
from d9d.kernels.expert_dispatch import AnyExpertDispatchConfig
from d9d.kernels.grouped_mm import AnyGroupedMmConfig
from d9d.kernels.linear_cross_entropy import AnyLinearCrossEntropyConfig
from d9d.kernels.moe_permute import AnyMoePermuteConfig
from d9d.kernels.rms_norm import AnyRmsNormConfig
from d9d.kernels.rope import AnyRopeConfig
from d9d.kernels.swiglu import AnySwiGluConfig


class DecoderConfig(BaseModel):
    """Behaviour of a decoder model; changing it never changes the parameters or a checkpoint.

    `attention` / `grouped_mm` / `rms_norm` / `swiglu` / `rope` / `moe_permute` / `linear_cross_entropy`: kernel
    backends (`None`: `D9D_BACKEND_AUTO_<FAMILY>`, else detected: Triton on a CUDA GPU with Triton installed for the
    last five, eager on CPU; see docs/kernels.md).
    `activation_checkpointing`: `True` for every layer, or the global indices of the layers to checkpoint;
    `checkpoint_policy`: `full` (recompute the whole layer) or `selective` (keep matmul and attention outputs).
    `compile_layers`: compile each decoder layer's forward (`compile_backend`, regional compilation; FSDP2-safe).
    `compile_model`: compile the whole model's forward as one graph instead (`build_model` applies it after
    parallelising; fastest with `SingleDeviceConfig`, where no FSDP hook breaks the graph; not with `compile_layers`,
    nor with pipeline parallelism, whose split backward needs the per-layer autograd graph).
    `loss_chunk_size`: tokens per chunk of the LM loss (bounds the logits held at once).
    `loss_gradients_in_forward`: the LM head computes the gradients of the loss *sum* in forward, from one logits
    matmul per chunk (backward only scales them): train through `CausalLMOutput.loss_sum`, whose `losses` are then
    detached. Tensor-parallel heads too. See docs/design/0023-loss-gradients-in-forward.md.
    `expert_dispatch`: the token exchange of expert parallelism (`None`: `D9D_BACKEND_AUTO_EXPERT_DISPATCH`, else
    detected); used only when the plan has `ep > 1`.
    `moe_capacity_factor`: drop the routed copies beyond `ceil(factor * tokens * top_k / experts)` per expert and
    rank (`None`, the default: no dropping).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention: AnyAttentionConfig | None = None
    grouped_mm: AnyGroupedMmConfig | None = None
    rms_norm: AnyRmsNormConfig | None = None
    swiglu: AnySwiGluConfig | None = None
    rope: AnyRopeConfig | None = None
    moe_permute: AnyMoePermuteConfig | None = None
    linear_cross_entropy: AnyLinearCrossEntropyConfig | None = None
    activation_checkpointing: bool | list[int] = False
    checkpoint_policy: Literal["full", "selective"] = "full"
    compile_layers: bool = False
    compile_model: bool = False
    compile_backend: str = "inductor"
    loss_chunk_size: int = Field(default=2048, gt=0)
    loss_gradients_in_forward: bool = False
    expert_dispatch: AnyExpertDispatchConfig | None = None
    moe_capacity_factor: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_compilation(self) -> DecoderConfig:
        if self.compile_layers and self.compile_model:
            raise ValueError(
                "compile_layers=True and compile_model=True: choose one (regional compilation of every layer, or one "
                "graph of the whole model)"
            )
        return self

    def checkpoints_layer(self, index: int) -> bool:
        if isinstance(self.activation_checkpointing, bool):
            return self.activation_checkpointing
        return index in self.activation_checkpointing
