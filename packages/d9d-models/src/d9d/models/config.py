"""`DecoderConfig`: how a model runs (kernels, checkpointing, loss chunking), as opposed to its `*Parameters`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from d9d.kernels.attention import AnyAttentionConfig
from d9d.kernels.expert_dispatch import AnyExpertDispatchConfig
from d9d.kernels.grouped_mm import AnyGroupedMmConfig


class DecoderConfig(BaseModel):
    """Behaviour of a decoder model; changing it never changes the parameters or a checkpoint.

    `attention` / `grouped_mm`: kernel backends (`None`: `D9D_BACKEND_AUTO_*`, else detected).
    `activation_checkpointing`: `True` for every layer, or the global indices of the layers to checkpoint.
    `loss_chunk_size`: tokens per chunk of the LM loss (bounds the logits held at once).
    `expert_dispatch`: the token exchange of expert parallelism (`None`: `D9D_BACKEND_AUTO_EXPERT_DISPATCH`, else
    detected); used only when the plan has `ep > 1`.
    `moe_capacity_factor`: drop the routed copies beyond `ceil(factor * tokens * top_k / experts)` per expert and
    rank (`None`, the default: no dropping).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention: AnyAttentionConfig | None = None
    grouped_mm: AnyGroupedMmConfig | None = None
    activation_checkpointing: bool | list[int] = False
    loss_chunk_size: int = Field(default=2048, gt=0)
    expert_dispatch: AnyExpertDispatchConfig | None = None
    moe_capacity_factor: float | None = Field(default=None, gt=0)

    def checkpoints_layer(self, index: int) -> bool:
        if isinstance(self.activation_checkpointing, bool):
            return self.activation_checkpointing
        return index in self.activation_checkpointing
