"""The Trainer and Inference in one process: events, accumulation-independence, validation, bits per byte."""

import math

import pytest
from loop_workload import (
    CausalLMTask,
    TinyModelProvider,
    build_tiny_trainer,
    data_provider_for,
    lr_provider,
    optimizer_provider,
    reference_losses,
)

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import (
    CheckpointSaved,
    EventBus,
    ForwardBackwardFinished,
    Inference,
    OptimizerStepped,
    ProfilingConfig,
    StepFinished,
    StepStarted,
    TrainerConfig,
    TrainingFinished,
    TrainingStarted,
    ValidationFinished,
    build_trainer,
)


@pytest.mark.distributed(world_size=1, timeout=120)
def test_events_fire_in_phase_order_and_accumulation_equals_one_big_batch(tmp_path):
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    events, seen = EventBus(), []
    for kind in (TrainingStarted, StepStarted, ForwardBackwardFinished, OptimizerStepped, StepFinished,
                 ValidationFinished, CheckpointSaved, TrainingFinished):  # fmt: skip
        events.subscribe(kind, lambda event: seen.append(type(event).__name__))
    trainer = build_tiny_trainer(
        ctx, family="dense", parallel="none", total_steps=4, microbatch_rows=2, checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=2, tracker_dir=tmp_path / "tracks", events=events, validation_every=2,
    )  # fmt: skip
    result = trainer.train()
    step = ["StepStarted", "ForwardBackwardFinished", "OptimizerStepped", "StepFinished"]
    checkpointed = ["ValidationFinished", "CheckpointSaved"]
    assert seen == ["TrainingStarted", *step, *step, *checkpointed, *step, *step, *checkpointed, "TrainingFinished"]
    # 4 micro-batches of 2 rows accumulated == the whole 8-row batch at once, to float32 summation order.
    reference = reference_losses("dense", total_steps=4)
    assert max(abs(result.losses[s + 1] - reference[s]) for s in range(4)) < 1e-5
    logged = (tmp_path / "tracks").glob("*.jsonl")
    lines = next(logged).read_text().splitlines()
    assert '"tokens_per_second"' in lines[0] and '"peak_memory_gib"' in lines[0]

    inference = Inference(ctx, model=trainer.parts.model, task=CausalLMTask(), data=data_provider_for(8, 2)(ctx, 4))
    evaluation = inference.run(steps=2)
    assert evaluation.perplexity == pytest.approx(math.exp(evaluation.loss))
    assert evaluation.bits_per_byte == pytest.approx(evaluation.loss / (4 * math.log(2)))  # 4 bytes per token
    assert 0.8 * math.log(96) < evaluation.loss < 1.2 * math.log(96)  # random tokens: near uniform


@pytest.mark.distributed(world_size=1, timeout=120)
def test_profiling_writes_a_trace_for_the_scheduled_steps(tmp_path):
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    config = TrainerConfig(
        total_steps=4, global_batch_rows=4, microbatch_rows=2,
        profiling=ProfilingConfig(directory=tmp_path, wait=1, warmup=1, active=1),
    )  # fmt: skip
    build_trainer(
        ctx, config, model_provider=TinyModelProvider("dense", "none"), task=CausalLMTask(),
        data_provider=data_provider_for(4, 2), optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider,
    ).train()  # fmt: skip
    traces = sorted(path.name for path in (tmp_path / "rank-00000").iterdir())
    assert traces == ["step-00000003.json"]
    assert "aten::" in (tmp_path / "rank-00000" / traces[0]).read_text()


@pytest.mark.distributed(world_size=1, timeout=120)
def test_export_hands_the_trained_model_to_the_exporter():
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    trainer = build_tiny_trainer(ctx, family="dense", parallel="none", total_steps=4, microbatch_rows=4)
    trainer.train()
    exported = {}
    trainer.export(lambda model: exported.update(model.state_dict()))
    assert exported.keys() == trainer.parts.model.state_dict().keys()
