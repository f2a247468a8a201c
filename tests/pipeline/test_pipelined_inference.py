"""The core `Inference` loop (and the Trainer's validation, which calls the same `evaluate`) on a pipelined model:
forward-only programs on both placements give the held-out loss of the whole model in one process (float32 sums in
another order: 1e-6 relative)."""

import pytest
import torch
from pipeline_workload import (
    LAYERS,
    CausalLMPipelineTask,
    build_meta,
    context,
    load_initial,
    synthetic_source,
)

from d9d.core.loop import Inference, SyntheticTokenSource, evaluate
from d9d.models import materialize_
from d9d.pipeline import (
    Interleaved1F1BConfig,
    PipelineConfig,
    PipelineStage,
    ZeroBubbleVConfig,
    build_pipeline_schedule,
)

ROWS, STEPS = 4, 2


def _source() -> SyntheticTokenSource:
    return synthetic_source(seed=11, global_rows=ROWS)


@pytest.mark.parametrize("schedule", [ZeroBubbleVConfig(), Interleaved1F1BConfig()])
@pytest.mark.distributed(world_size=2, timeout=240)
def test_inference_on_a_pipelined_model_equals_one_process(schedule):
    ctx = context(2)

    def build_stage(stage: PipelineStage) -> torch.nn.Module:
        module = materialize_(build_meta("moe", stage), "cpu")
        load_initial(module, "moe")
        return module

    pipelined = build_pipeline_schedule(
        PipelineConfig(schedule=schedule), ctx, num_layers=LAYERS, num_microbatches=ROWS, build_stage=build_stage
    )
    task = CausalLMPipelineTask()
    result = Inference(ctx, model=pipelined.model, task=task, data=_source(), schedule=pipelined).run(STEPS)
    whole = materialize_(build_meta("moe", PipelineStage()), "cpu")
    load_initial(whole, "moe")
    expected = evaluate(whole, task, _source(), steps=STEPS, group=None)
    assert result.tokens == expected.tokens
    assert result.loss == pytest.approx(expected.loss, rel=1e-6)
