"""`PipelineCosts`: what a model's layers, embedding and head cost per micro-batch, so zero-bubble builders and the
simulator can plan with each stage's real forward, input-gradient and weight-gradient durations."""

from __future__ import annotations

from collections.abc import Sequence

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
        """The forward / input-gradient / weight-gradient cost of `stage` of a `num_layers`-layer model.

        The first stage has no input gradient to hand back, so the executor's split backward does nothing in its `I`
        and the whole backward in its `W` (the layers' input-side gradients are what their weight gradients and the
        embedding's need): its input-gradient cost is folded into its weight-gradient cost. A full backward costs
        the same either way.
        """
        layers = len(stage.layers(num_layers))
        parts = [(float(layers), self.layer)]
        if stage.is_first:
            parts.append((1.0, self.embedding))
        if stage.is_last:
            parts.append((1.0, self.head))
        backward_input = sum(count * part.backward_input for count, part in parts)
        backward_weight = sum(count * part.backward_weight for count, part in parts)
        if stage.is_first:
            backward_input, backward_weight = 0.0, backward_input + backward_weight
        return StageCost(
            forward=sum(count * part.forward for count, part in parts),
            backward_input=backward_input,
            backward_weight=backward_weight,
        )

    def stage_costs(
        self, num_stages: int, num_layers: int, *, virtual_layers_pre: int = 0, virtual_layers_post: int = 0
    ) -> tuple[StageCost, ...]:
        """One `StageCost` per global stage, for the split `PipelineStage` makes with these virtual layers."""
        return tuple(
            self.stage_cost(PipelineStage(index, num_stages, virtual_layers_pre, virtual_layers_post), num_layers)
            for index in range(num_stages)
        )

    @classmethod
    def from_stage_costs(
        cls,
        stage_costs: Sequence[StageCost],
        num_layers: int,
        *,
        virtual_layers_pre: int = 0,
        virtual_layers_post: int = 0,
    ) -> PipelineCosts:
        """The cost model that measured per-stage durations imply (any time unit; e.g. each stage's median GPU ms per
        forward, input-gradient and weight-gradient action from a profiled step of a split-backward schedule, as
        `bench/pipeline_schedules.py --trace-dir` measures them).

        A layer costs what the stages holding neither the embedding nor the head cost per layer, on average; the
        head and the embedding cost what their stages take beyond their layers (clipped at 0: measurement noise).
        The first stage's measured weight-gradient pass is its whole backward (`stage_cost`), so its layers' input
        and weight gradients both come off it; its input-gradient pass does nothing and is not read.
        Everything is returned in units of the measured layer forward. Needs at least one stage with layers and
        neither end of the model, a forward measured there, and a weight-gradient measurement somewhere (a schedule
        with full backwards cannot tell the two halves apart).
        """
        num_stages = len(stage_costs)
        stages = [
            PipelineStage(index, num_stages, virtual_layers_pre, virtual_layers_post) for index in range(num_stages)
        ]
        if not any(cost.backward_weight for cost in stage_costs):
            raise ValueError(
                "PipelineCosts.from_stage_costs needs weight-gradient measurements (every stage_costs[i]."
                "backward_weight is 0): measure a split-backward schedule (zb_h1, zbv, dualpipe_v), whose actions "
                "separate the input gradient from the weight gradient"
            )
        middle = [
            (cost, len(stage.layers(num_layers)))
            for cost, stage in zip(stage_costs, stages, strict=True)
            if not stage.is_first and not stage.is_last and stage.layers(num_layers)
        ]
        layers = sum(count for _, count in middle)
        forward = sum(cost.forward for cost, _ in middle) / layers if layers else 0.0
        if not forward > 0:
            raise ValueError(
                f"PipelineCosts.from_stage_costs: {num_stages} stages of a {num_layers}-layer model with "
                f"virtual_layers_pre={virtual_layers_pre} and virtual_layers_post={virtual_layers_post} leave no "
                "stage with layers and neither the embedding nor the head whose forward was measured; measure with "
                "more stages (pp x stages per rank of at least 3) or fewer virtual layers"
            )
        per_layer = StageCost(
            forward=forward,
            backward_input=sum(cost.backward_input for cost, _ in middle) / layers,
            backward_weight=sum(cost.backward_weight for cost, _ in middle) / layers,
        )

        def beyond_layers(index: int) -> WorkCost:
            count = len(stages[index].layers(num_layers))
            measured, layers_cost = stage_costs[index], per_layer
            if stages[index].is_first:  # its W ran the whole backward, its I nothing
                measured = StageCost(measured.forward, 0.0, measured.backward_input + measured.backward_weight)
                layers_cost = StageCost(per_layer.forward, 0.0, per_layer.backward_input + per_layer.backward_weight)
            extra = {
                name: max(getattr(measured, name) - count * getattr(layers_cost, name), 0.0) / forward
                for name in ("forward", "backward_input", "backward_weight")
            }
            return WorkCost(**extra)

        return cls(
            layer=WorkCost(
                forward=1.0,
                backward_input=per_layer.backward_input / forward,
                backward_weight=per_layer.backward_weight / forward,
            ),
            head=beyond_layers(num_stages - 1),
            embedding=beyond_layers(0),
        )
