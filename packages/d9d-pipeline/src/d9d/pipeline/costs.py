"""`PipelineCosts`: what a model's layers, embedding and head cost per micro-batch, so zero-bubble builders and the
simulator can plan with each stage's real forward, input-gradient and weight-gradient durations."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from d9d.pipeline.program.replay import StageCost
from d9d.pipeline.stage import PipelineStage


class WorkCost(BaseModel):
    """Forward, input-gradient and weight-gradient cost of one piece of the model on one micro-batch, in units of one
    decoder layer's forward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    forward: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    backward_input: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    backward_weight: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class PipelineCosts(BaseModel):
    """A cost model of the pipelined model, in decoder-layer forwards (measure them: a profiler trace of one step).

    A stage costs its real layers times `layer`, plus `embedding` on the first stage and `head` (final norm, LM head
    and loss) on the last. Where a piece's backward lands matters for split-backward schedules: a loss whose
    gradients are recomputed chunk by chunk in backward puts the head's whole backward in `backward_input`; the
    embedding (no input gradient) has only `backward_weight`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    layer: WorkCost = Field(default_factory=lambda: WorkCost(forward=1.0, backward_input=1.0, backward_weight=1.0))
    head: WorkCost = Field(default_factory=WorkCost)
    embedding: WorkCost = Field(default_factory=WorkCost)

    def stage_cost(self, stage: PipelineStage, num_layers: int) -> StageCost:
        """The forward / input-gradient / weight-gradient cost of `stage` of a `num_layers`-layer model."""
        layers = len(stage.layers(num_layers))
        parts = [(float(layers), self.layer)]
        if stage.is_first:
            parts.append((1.0, self.embedding))
        if stage.is_last:
            parts.append((1.0, self.head))
        return StageCost(
            forward=sum(count * part.forward for count, part in parts),
            backward_input=sum(count * part.backward_input for count, part in parts),
            backward_weight=sum(count * part.backward_weight for count, part in parts),
        )

    def stage_costs(
        self, num_stages: int, num_layers: int, *, virtual_layers_pre: int = 0, virtual_layers_post: int = 0
    ) -> tuple[StageCost, ...]:
        """One `StageCost` per global stage, for the split `PipelineStage` makes with these virtual layers."""
        return tuple(
            self.stage_cost(PipelineStage(index, num_stages, virtual_layers_pre, virtual_layers_post), num_layers)
            for index in range(num_stages)
        )
