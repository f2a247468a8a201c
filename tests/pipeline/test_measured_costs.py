"""Measured costs inside a job (design note 0030): `measure_stage_costs` times every compute action of a real step
of the schedule, `PipelineCosts.from_stage_costs` turns the durations into a cost model, and
`PipelineSchedule.replan` rebuilds the zero-bubble programs under it for the steps that follow.

On gloo, tiny Qwen3 dense, pp=2 ZBV (4 stages of 2 layers). The durations are the CPU's wall clock and noisy, so the
test checks what must hold whatever they are: every rank gets the same costs, timing does not change the step's
arithmetic (loss and gradients bitwise equal to an untimed step), and the replanned program computes the same
gradients as the original one in another order. Tolerance for that: float32 sums in another order, a few ulps of
values about 1 (1e-5 relative, as the parity tests).
"""

import pytest
import torch
import torch.distributed as dist
from pipeline_workload import (
    LAYERS,
    CausalLMPipelineTask,
    context,
    dense_schedule,
    errors_against,
    pipelined_run,
    shared_reference,
    synthetic_source,
)
from pydantic import ValidationError

# The parity tests' workload and float32 tolerances (their docstring explains them): a replanned program reorders
# the same actions, so the sums differ from single-process training by the same few ulps.
from test_pipeline_parity import LOSS_RTOL, NORM_RTOL, PARAM_ATOL, ROWS, STEPS

from d9d.pipeline import (
    PipelineConfig,
    PipelineCosts,
    ZeroBubbleH1Config,
    ZeroBubbleVConfig,
    measure_stage_costs,
    plan_pipeline,
)
from d9d.pipeline.program import Action, ActionKind, validate_program

MICROBATCHES = 8
GRAD_RTOL = 1e-5


def _gradients(schedule, task, batches, loss_scale):
    for param in schedule.model.parameters():
        param.grad = None
    result = schedule.run(schedule.model, task, batches, loss_scale=loss_scale, backward=True)
    grads = {name: param.grad.detach().clone() for name, param in schedule.model.named_parameters()}
    return float(result.loss_sum), grads


@pytest.mark.distributed(world_size=2, timeout=240)
def test_a_measured_step_replans_the_schedule_without_changing_its_arithmetic():
    config = PipelineConfig(schedule=ZeroBubbleVConfig())
    schedule = dense_schedule(context(2), config, num_layers=LAYERS, num_microbatches=MICROBATCHES)
    if dist.get_rank() == 0:  # stages 0 and 3: the first stage's gradient comes from rank 1, read by its W only
        first_input, first_weight = Action(0, ActionKind.BACKWARD_INPUT, 3), Action(0, ActionKind.BACKWARD_WEIGHT, 3)
        assert schedule.executor.receives_of(first_input) == ()
        assert schedule.executor.receives_of(first_weight) == (("B", 0, 3),)
        assert schedule.executor.receives_of(Action(3, ActionKind.FORWARD, 3)) == (("F", 3, 3),)
    task = CausalLMPipelineTask()
    source = synthetic_source(seed=5, global_rows=MICROBATCHES)
    batches = source.next_step()
    loss_scale = 1.0 / sum(task.count_tokens(batch) for batch in batches)
    loss, grads = _gradients(schedule, task, batches, loss_scale)  # also the warm-up the docstring asks for

    for param in schedule.model.parameters():
        param.grad = None
    costs, measured = measure_stage_costs(schedule, task, batches, loss_scale=loss_scale)
    assert float(measured.loss_sum) == loss  # timing waits and brackets, it computes nothing else
    for name, param in schedule.model.named_parameters():
        assert torch.equal(param.grad, grads[name]), name

    assert len(costs) == 4  # every global stage, whichever rank ran it
    assert all(cost.forward > 0 and cost.backward_weight > 0 for cost in costs)
    assert all(cost.backward_input > 0 for cost in costs[1:])  # stage 0 has no input gradient to compute
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, costs)
    assert all(other == costs for other in everyone)

    model = PipelineCosts.from_stage_costs(costs, LAYERS)
    assert model.layer.forward == 1.0
    before = schedule.program(MICROBATCHES, training=True)
    assert any(program is before for program in schedule.executor.programs_held())
    schedule.replan(model)
    assert schedule.program(MICROBATCHES, training=True) is not before  # built again, under the measured costs
    # The old program never runs again: the executor lets go of it (on a GPU its CUDA graphs' memory pool too).
    assert all(program is not before for program in schedule.executor.programs_held())
    assert schedule.plan is not None
    assert schedule.plan.config.costs == model
    validate_program(schedule.program(MICROBATCHES, training=True))
    replanned_loss, replanned = _gradients(schedule, task, batches, loss_scale)
    assert replanned_loss == pytest.approx(loss, rel=GRAD_RTOL)
    for name, grad in grads.items():
        torch.testing.assert_close(replanned[name], grad, rtol=GRAD_RTOL, atol=1e-7, msg=name)

    schedule.plan = None
    with pytest.raises(ValueError, match=r"built without a PipelinePlan \(plan=None\)"):
        schedule.replan(model)


@pytest.mark.distributed(world_size=2, timeout=240)
def test_measuring_at_step_two_replans_the_rest_and_training_matches_single_process():
    # Step 1 warms up, step 2 is timed (a real step: the Trainer uses its loss and gradients), steps 3-10 run the
    # program planned under the measured model; the run must still be single-process training.
    config = PipelineConfig(schedule=ZeroBubbleVConfig(activation_memory=1.5), measure_costs_at_step=2)
    record = pipelined_run(context(2), "dense", config, steps=STEPS, global_rows=ROWS)
    assert record.measured_costs is not None
    assert record.measured_costs.layer.forward == 1.0
    assert record.measured_costs.layer.backward_input > 0
    errors = errors_against(record, shared_reference("dense", steps=STEPS, global_rows=ROWS))
    if dist.get_rank() == 0:
        print(f"measured at step 2: loss {errors.loss:.1e} norm {errors.norm:.1e} params {errors.params:.1e}")
    assert errors.loss < LOSS_RTOL
    assert errors.norm < NORM_RTOL
    assert errors.params < PARAM_ATOL


def test_measuring_costs_is_refused_where_nothing_could_use_them():
    with pytest.raises(ValueError, match=r"measure_costs_at_step=2 with schedule '1f1b'.*\(zb_h1, zbv\)"):
        plan_pipeline(PipelineConfig(measure_costs_at_step=2), pp=4, num_layers=LAYERS, num_microbatches=MICROBATCHES)
    with pytest.raises(ValueError, match=r"measure_costs_at_step=3: 2 stages \(pp=2, zb_h1\).*pp of at least 3"):
        plan_pipeline(
            PipelineConfig(schedule=ZeroBubbleH1Config(), measure_costs_at_step=3),
            pp=2,
            num_layers=LAYERS,
            num_microbatches=MICROBATCHES,
        )
    with pytest.raises(ValidationError, match=r"measure_costs_at_step\n.*greater than or equal to 1"):
        PipelineConfig.model_validate({"measure_costs_at_step": 0})
