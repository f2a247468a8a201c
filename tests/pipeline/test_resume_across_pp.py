"""Job checkpoints of a pipelined job resume with another pp. Parameter and optimizer-state names are global (stages
build an `nn.ModuleDict` keyed by global layer index, and the schedule's model view merges a rank's stages under
those names), so DCP reshards them like any other layout change.

A run trains 8 steps with a checkpoint at step 4 under one layout; the step-8 checkpoint is removed, and a second
Trainer under another layout resumes from step 4. Its losses for steps 5-8 and final parameters must equal the
single-process reference over 8 steps (same tolerances as the parity tests)."""

import shutil

import pytest
import torch.distributed as dist
from pipeline_workload import all_ranks_max, context, max_param_error, max_relative, pipelined_run, shared_reference

from d9d.pipeline import OneFOneBConfig, PipelineConfig, ZeroBubbleVConfig

STEPS, ROWS = 8, 8
LOSS_RTOL, PARAM_ATOL = 1e-6, 2e-6


def _resume(tmp_path, first: tuple[int, int, PipelineConfig], second: tuple[int, int, PipelineConfig]) -> None:
    root = tmp_path / "checkpoints"
    pp, dp_shard, config = first
    pipelined_run(
        context(pp, dp_shard),
        "moe",
        config,
        steps=STEPS,
        global_rows=ROWS,
        fsdp=dp_shard > 1,
        checkpoint_dir=root,
        checkpoint_every=4,
    )
    if dist.get_rank() == 0:
        shutil.rmtree(root / "step-00000008")
    dist.barrier()
    pp, dp_shard, config = second
    resumed = pipelined_run(
        context(pp, dp_shard), "moe", config, steps=STEPS, global_rows=ROWS, fsdp=dp_shard > 1, checkpoint_dir=root
    )
    reference = shared_reference("moe", steps=STEPS, global_rows=ROWS)
    assert max_relative(resumed.losses, [step.losses[0] for step in reference[4:]]) < LOSS_RTOL
    assert all_ranks_max(max_param_error(resumed.params, reference[-1].params)) < PARAM_ATOL


@pytest.mark.distributed(world_size=2, timeout=300)
def test_pp2_checkpoint_resumes_with_pp1(tmp_path):
    _resume(tmp_path, (2, 1, PipelineConfig(schedule=OneFOneBConfig())), (1, 2, PipelineConfig()))


@pytest.mark.distributed(world_size=4, timeout=400)
def test_pp1_checkpoint_resumes_with_pp4_zbv(tmp_path):
    _resume(tmp_path, (1, 4, PipelineConfig()), (4, 1, PipelineConfig(schedule=ZeroBubbleVConfig())))


@pytest.mark.distributed(world_size=4, timeout=300)
def test_export_gathers_every_stage_of_pp2_with_fsdp():
    """pp=2 x dp_shard=2 (stages FSDP-sharded): pipeline rank 0 ends up with the whole model's state, equal to the
    single-process model's, ready for a Hugging Face writer."""
    import torch
    from pipeline_workload import LAYERS, build_meta, initial_state, load_initial

    from d9d.models import materialize_
    from d9d.models.qwen3 import parallelize_qwen3_moe
    from d9d.parallel import FsdpConfig
    from d9d.pipeline import gather_pipeline_state, merge_stage_modules, pipeline_group, plan_pipeline

    ctx = context(2, 2)
    plan = plan_pipeline(PipelineConfig(schedule=ZeroBubbleVConfig()), pp=2, num_layers=LAYERS, num_microbatches=4)
    stages = []
    for stage in plan.stages_of(ctx.pp_rank):
        module = build_meta("moe", stage)
        parallelize_qwen3_moe(module, ctx, FsdpConfig())
        materialize_(module, ctx.device)
        load_initial(module, "moe")
        stages.append(module)
    state = gather_pipeline_state(merge_stage_modules(stages), pipeline_group(ctx))
    if ctx.pp_rank != 0:
        assert state is None
        return
    expected = initial_state("moe")
    assert state is not None and set(state) == set(expected)
    assert all(torch.equal(state[name], expected[name]) for name in expected)
