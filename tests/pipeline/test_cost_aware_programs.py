"""Cost-aware zero-bubble programs (design note 0027): per-stage, per-kind costs in the simulator, the `PipelineCosts`
model, greedy ZB-H1/ZBV orders planned with it, the split search, and one gloo parity run of a cost-aware ZBV."""

from functools import partial

import pytest
import torch.distributed as dist
from pipeline_workload import (
    LAYERS,
    context,
    errors_against,
    pipelined_run,
    shared_reference,
)
from pydantic import ValidationError

# Same workload and tolerances as test_pipeline_parity.py (float32; its docstring explains them): a cost model only
# reorders the same actions, so the step's sums differ from single-process training by the same few ulps.
from test_pipeline_parity import LOSS_RTOL, NORM_RTOL, PARAM_ATOL, ROWS, STEPS

from d9d.pipeline import (
    PipelineConfig,
    PipelineCosts,
    PipelineStage,
    WorkCost,
    ZeroBubbleH1Config,
    ZeroBubbleVConfig,
    plan_pipeline,
    simulate_split,
    suggest_virtual_layers,
)
from d9d.pipeline.program import (
    ActionCosts,
    StageCost,
    build_program,
    one_f_one_b,
    replay,
    validate_program,
    zero_bubble_v,
)

# The dense anchor measured on 4 x H200 at 4 x 4096 tokens per micro-batch, in layer-forward units: the chunked loss
# puts the whole head backward in the input gradient, the embedding's backward is a weight gradient.
MEASURED = PipelineCosts(
    head=WorkCost(forward=5.3, backward_input=17.8, backward_weight=0.0),
    embedding=WorkCost(backward_weight=0.3),
)
COST_MODELS = {
    "measured": MEASURED,
    "heavy_embedding": PipelineCosts(embedding=WorkCost(forward=3.0, backward_weight=6.0)),
    "free_weight_gradients": PipelineCosts(layer=WorkCost(forward=1.0, backward_input=2.0, backward_weight=0.0)),
    "slow_layers_light_head": PipelineCosts(
        layer=WorkCost(forward=2.0, backward_input=1.5, backward_weight=3.0), head=WorkCost(forward=0.5)
    ),
}
ZERO_BUBBLE = {"zb_h1": ZeroBubbleH1Config(), "zbv": ZeroBubbleVConfig()}


def test_stage_cost_rejects_negative_and_non_finite_durations():
    with pytest.raises(ValueError, match=r"StageCost.forward=-1.0 must be a finite non-negative"):
        StageCost(forward=-1.0)
    with pytest.raises(ValueError, match=r"StageCost.backward_weight=nan"):
        StageCost(backward_weight=float("nan"))
    with pytest.raises(ValueError, match=r"StageCost.backward_input=inf"):
        StageCost(backward_input=float("inf"))


def test_stage_costs_must_match_the_stages_and_replace_the_uniform_fields():
    program = build_program("zbv", partial(zero_bubble_v, 2, 4), 4)  # 4 global stages
    with pytest.raises(ValueError, match=r"stage_costs has 3 entries; the program has 4 global stages"):
        replay(program, ActionCosts(stage_costs=(StageCost(),) * 3))
    with pytest.raises(ValueError, match=r"leave stage_weights \(got \(1.0, 2.0\)\)"):
        ActionCosts(stage_weights=(1.0, 2.0), stage_costs=(StageCost(), StageCost()))
    with pytest.raises(ValueError, match=r"forward/backward_input/backward_weight \(got 2.0/1.0/1.0\)"):
        ActionCosts(forward=2.0, stage_costs=(StageCost(),))
    with pytest.raises(ValueError, match=r"stage_costs=\(\) must name one StageCost per global stage"):
        ActionCosts(stage_costs=())


def test_pipeline_costs_reject_bad_values_naming_the_field():
    with pytest.raises(ValidationError, match=r"head.backward_input\n.*greater than or equal to 0"):
        PipelineCosts.model_validate({"head": {"backward_input": -2}})
    with pytest.raises(ValidationError, match=r"layer.backward\n.*Extra inputs are not permitted"):
        PipelineCosts.model_validate({"layer": {"backward": 2}})
    with pytest.raises(ValidationError, match=r"costs.embedding.forward\n.*finite number"):
        PipelineConfig.model_validate({"costs": {"embedding": {"forward": "inf"}}})


def test_stage_costs_follow_the_layers_of_each_stage():
    # 8 layers, pre 1, post 1 over 4 stages: 10 slots as 3, 3, 2, 2: stage 0 gets layers 0-1 plus the embedding,
    # stage 3 layer 7 plus the head. The first stage hands no input gradient back: the executor's split backward
    # runs its whole backward in W (layers' input and weight gradients, the embedding's), nothing in I.
    costs = MEASURED.stage_costs(4, 8, virtual_layers_pre=1, virtual_layers_post=1)
    layers = [len(PipelineStage(i, 4, 1, 1).layers(8)) for i in range(4)]
    assert layers == [2, 3, 2, 1]
    assert costs[0] == StageCost(forward=2.0, backward_input=0.0, backward_weight=2 * (1.0 + 1.0) + 0.3)
    assert costs[1] == StageCost(3.0, 3.0, 3.0)
    assert costs[3] == StageCost(forward=1.0 + 5.3, backward_input=1.0 + 17.8, backward_weight=1.0)


ANCHOR_ON_H200 = PipelineCosts(  # the dense anchor's costs measured on 4 x H200 with CUDA graphs (docs/benchmarks.md,
    # session 13; session 12's embedding weight gradient of 2.47 still held the first stage's layers' input gradients)
    layer=WorkCost(forward=1.0, backward_input=2.00, backward_weight=0.43),
    head=WorkCost(forward=5.94, backward_input=15.93, backward_weight=0.06),
    embedding=WorkCost(forward=0.23, backward_weight=0.89),
)


@pytest.mark.parametrize(("pp", "pre", "post"), [(4, 4, 3), (4, 0, 0), (2, 1, 5)])
def test_a_cost_model_is_recovered_from_the_stage_durations_it_implies(pp, pre, post):
    # Durations in ms (a layer forward of 1.6 ms), as a profiled ZBV step measures them: the model they imply is the
    # one that made them, in layer-forward units, whatever the split.
    stages = ANCHOR_ON_H200.stage_costs(2 * pp, 32, virtual_layers_pre=pre, virtual_layers_post=post)
    in_ms = [StageCost(1.6 * c.forward, 1.6 * c.backward_input, 1.6 * c.backward_weight) for c in stages]
    derived = PipelineCosts.from_stage_costs(in_ms, 32, virtual_layers_pre=pre, virtual_layers_post=post)
    for part in ("layer", "head", "embedding"):
        for name in ("forward", "backward_input", "backward_weight"):
            assert getattr(getattr(derived, part), name) == pytest.approx(getattr(getattr(ANCHOR_ON_H200, part), name))


def test_the_first_stage_is_measured_as_the_executor_runs_it():
    # Measured durations of the first stage: its I does nothing (a timer still brackets it), its W is its layers'
    # whole backward plus the embedding's. The embedding's weight gradient is what W holds beyond the layers' I + W.
    stages = list(ANCHOR_ON_H200.stage_costs(8, 32, virtual_layers_pre=4, virtual_layers_post=3))
    layers = len(PipelineStage(0, 8, 4, 3).layers(32))
    layer = ANCHOR_ON_H200.layer
    assert stages[0].backward_input == 0.0
    assert stages[0].backward_weight == pytest.approx(layers * (layer.backward_input + layer.backward_weight) + 0.89)
    stages[0] = StageCost(stages[0].forward, 0.02, stages[0].backward_weight)  # the empty I's timing noise
    derived = PipelineCosts.from_stage_costs(stages, 32, virtual_layers_pre=4, virtual_layers_post=3)
    assert derived.embedding.backward_input == 0.0
    assert derived.embedding.backward_weight == pytest.approx(0.89 + 0.02)


def test_noise_below_the_layers_clips_to_zero():
    # The head's stage measured slightly under its layers' share (noise): no negative cost, which WorkCost refuses.
    stages = list(ANCHOR_ON_H200.stage_costs(8, 32))
    stages[-1] = StageCost(stages[-1].forward, stages[-1].backward_input, 0.0)
    derived = PipelineCosts.from_stage_costs(stages, 32)
    assert derived.head.backward_weight == 0.0


def test_deriving_a_cost_model_names_what_is_missing():
    full_backwards = [StageCost(4.0, 8.0, 0.0)] * 8  # a 1F1B trace: input and weight gradients are one action
    with pytest.raises(ValueError, match=r"backward_weight is 0.*split-backward schedule"):
        PipelineCosts.from_stage_costs(full_backwards, 32)
    two_stages = [StageCost(4.0, 8.0, 2.0)] * 2  # pp=2 with one stage per rank: no stage without an end
    with pytest.raises(ValueError, match=r"2 stages of a 32-layer model.*virtual_layers_pre=0"):
        PipelineCosts.from_stage_costs(two_stages, 32)


def test_per_stage_costs_charge_each_action_its_own_kind():
    program = build_program("1f1b", partial(one_f_one_b, 2, 4), 4)
    uniform = replay(program)
    same = replay(program, ActionCosts(stage_costs=(StageCost(), StageCost())))
    assert same.makespan == pytest.approx(uniform.makespan)
    # A last stage whose input gradient costs 10: its full backward costs 11 (input + weight gradient).
    heavy = replay(program, ActionCosts(stage_costs=(StageCost(), StageCost(backward_input=10.0))))
    durations = {item.action: item.end - item.start for item in heavy.ranks[1]}
    assert {round(value, 9) for action, value in durations.items() if action.kind.name == "BACKWARD"} == {11.0}
    assert heavy.makespan > uniform.makespan


@pytest.mark.parametrize("cost_model", sorted(COST_MODELS))
@pytest.mark.parametrize("kind", sorted(ZERO_BUBBLE))
def test_cost_aware_zero_bubble_programs_validate(kind, cost_model):
    for pp in (2, 4):
        for m in (8, 16):
            for pre, post in ((0, 0), (2, 4)):
                config = PipelineConfig(
                    schedule=ZERO_BUBBLE[kind],
                    costs=COST_MODELS[cost_model],
                    virtual_layers_pre=pre,
                    virtual_layers_post=post,
                )
                plan = plan_pipeline(config, pp=pp, num_layers=16, num_microbatches=m)
                validate_program(plan.program(m))  # plan_pipeline validated too; checked again explicitly


def _peak_alive(program) -> int:
    """The most forwards any rank holds before their weight gradient (the activation memory bound)."""
    peak = 0
    for actions in program.ranks.values():
        alive = 0
        for action in actions:
            alive += {"FORWARD": 1, "BACKWARD_WEIGHT": -1, "BACKWARD": -1}.get(action.kind.name, 0)
            peak = max(peak, alive)
    return peak


@pytest.mark.parametrize("kind", sorted(ZERO_BUBBLE))
def test_cost_aware_programs_keep_the_memory_bound(kind):
    bound = {"zb_h1": 4, "zbv": 8}[kind]  # pp=4: p for ZB-H1, 2p stage-activations for ZBV
    for costs in COST_MODELS.values():
        for pre, post in ((0, 0), (4, 4), (1, 7)):
            config = PipelineConfig(
                schedule=ZERO_BUBBLE[kind], costs=costs, virtual_layers_pre=pre, virtual_layers_post=post
            )
            plan = plan_pipeline(config, pp=4, num_layers=32, num_microbatches=16)
            assert _peak_alive(plan.program(16)) <= bound


@pytest.mark.parametrize("kind", sorted(ZERO_BUBBLE))
@pytest.mark.parametrize("memory", [1.5, 2.0, 4.0])
def test_an_activation_budget_bounds_what_a_rank_holds(kind, memory):
    base = {"zb_h1": 4, "zbv": 8}[kind]  # pp=4: 1F1B's memory in stage activations
    for costs in (None, ANCHOR_ON_H200):
        schedule = ZERO_BUBBLE[kind].model_copy(update={"activation_memory": memory})
        config = PipelineConfig(schedule=schedule, costs=costs, virtual_layers_pre=4, virtual_layers_post=3)
        program = plan_pipeline(config, pp=4, num_layers=32, num_microbatches=16).program(16)
        validate_program(program)
        assert base < _peak_alive(program) <= int(base * memory)  # the budget is used, never exceeded


def test_more_activation_memory_lets_zbv_fill_the_anchor_bubbles():
    # Under the anchor's measured costs a weight gradient is 0.43 of a forward: too little to fill the warm-up and
    # cool-down at 1F1B's memory. Twice the activations lets the order run ahead (ZB-2p's trade); the simulated
    # bubble must drop well below the published bound's (0.146 -> 0.073 when measured in session 12).
    shape = {"pp": 4, "num_layers": 32, "num_microbatches": 16}
    bubbles = {}
    for memory in (1.0, 2.0):
        schedule = ZeroBubbleVConfig(activation_memory=memory)
        config = PipelineConfig(schedule=schedule, costs=ANCHOR_ON_H200, virtual_layers_pre=4, virtual_layers_post=3)
        bubbles[memory] = simulate_split(config, **shape).bubble
    assert bubbles[2.0] < 0.6 * bubbles[1.0]


def test_an_activation_budget_below_1f1bs_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match=r"schedule.zbv.activation_memory\n.*greater than or equal to 1"):
        PipelineConfig.model_validate({"schedule": {"kind": "zbv", "activation_memory": 0.5}})
    with pytest.raises(ValueError, match=r"activation_memory=0.5 must be a finite factor of at least 1.0"):
        zero_bubble_v(4, 16, activation_memory=0.5)


@pytest.mark.parametrize("kind", sorted(ZERO_BUBBLE))
@pytest.mark.parametrize("split", [(0, 0), (4, 4), (1, 7)])
def test_cost_aware_programs_are_no_slower_under_their_costs(kind, split):
    pre, post = split
    uniform = PipelineConfig(schedule=ZERO_BUBBLE[kind], virtual_layers_pre=pre, virtual_layers_post=post)
    aware = uniform.model_copy(update={"costs": MEASURED})
    shape = {"pp": 4, "num_layers": 32, "num_microbatches": 16}
    built_uniform = simulate_split(uniform, costs=MEASURED, **shape)
    built_aware = simulate_split(aware, **shape)
    assert built_aware.makespan <= built_uniform.makespan + 1e-9, (built_aware, built_uniform)


def test_no_cost_model_builds_todays_programs():
    # `costs=None` reaches the builders as no costs at all: the same program as the builder alone, action by action.
    for pp, m in ((2, 8), (4, 16)):
        plan = plan_pipeline(PipelineConfig(schedule=ZeroBubbleVConfig()), pp=pp, num_layers=16, num_microbatches=m)
        direct = build_program("zbv", partial(zero_bubble_v, pp, m), m)
        assert plan.program(m).ranks == direct.ranks
        aware = plan_pipeline(
            PipelineConfig(schedule=ZeroBubbleVConfig(), costs=MEASURED), pp=pp, num_layers=16, num_microbatches=m
        )
        assert aware.program(m).ranks != direct.ranks  # the cost model does reach the builder


@pytest.mark.parametrize("kind", ["1f1b", "zbv"])
def test_suggested_split_is_valid_and_beats_the_even_split(kind):
    config = PipelineConfig.model_validate({"schedule": {"kind": kind}, "costs": MEASURED.model_dump()})
    shape = {"pp": 2, "num_layers": 16, "num_microbatches": 8}
    best = suggest_virtual_layers(config, **shape)
    even = simulate_split(config, **shape)
    chosen = config.model_copy(
        update={"virtual_layers_pre": best.virtual_layers_pre, "virtual_layers_post": best.virtual_layers_post}
    )
    again = simulate_split(chosen, **shape)  # plans (validates) the suggested split and reproduces its numbers
    assert again == best
    assert min(best.layers_per_stage) >= 1 and sum(best.layers_per_stage) == 16
    assert best.makespan <= even.makespan
    assert best.makespan < even.makespan  # the heavy head on the last stage leaves room to balance
    with pytest.raises(ValueError, match=r"max_virtual_layers=-1 must be non-negative"):
        suggest_virtual_layers(config, max_virtual_layers=-1, **shape)


@pytest.mark.distributed(world_size=2, timeout=240)
@pytest.mark.parametrize("memory", [1.0, 2.0])
def test_cost_aware_zbv_matches_single_process_pp2(memory):
    # With twice the activation memory the order runs further ahead (more forwards before the first weight
    # gradients): another program, the same sums.
    costs = PipelineCosts(head=WorkCost(forward=3.0, backward_input=9.0), embedding=WorkCost(backward_weight=0.5))
    config = PipelineConfig(schedule=ZeroBubbleVConfig(activation_memory=memory), costs=costs, virtual_layers_post=1)
    ctx = context(2)
    plan = plan_pipeline(config, pp=2, num_layers=LAYERS, num_microbatches=ROWS)
    uniform = plan_pipeline(config.model_copy(update={"costs": None}), pp=2, num_layers=LAYERS, num_microbatches=ROWS)
    assert plan.program(ROWS).ranks != uniform.program(ROWS).ranks  # a different order really runs
    if memory > 1:
        published = config.model_copy(update={"schedule": ZeroBubbleVConfig()})
        as_published = plan_pipeline(published, pp=2, num_layers=LAYERS, num_microbatches=ROWS).program(ROWS)
        assert plan.program(ROWS).ranks != as_published.ranks
        assert _peak_alive(plan.program(ROWS)) > _peak_alive(as_published)
    record = pipelined_run(ctx, "dense", config, steps=STEPS, global_rows=ROWS)
    errors = errors_against(record, shared_reference("dense", steps=STEPS, global_rows=ROWS))
    if dist.get_rank() == 0:
        print(
            f"cost-aware zbv pp=2 memory {memory}: loss {errors.loss:.1e} norm {errors.norm:.1e}"
            f" params {errors.params:.1e}"
        )
    assert errors.loss < LOSS_RTOL
    assert errors.norm < NORM_RTOL
    assert errors.params < PARAM_ATOL


def test_stage_configs_accept_a_cost_model():
    from d9d.flows.jobs.topology import RankTopology

    topology = RankTopology.model_validate(
        {"pipeline": {"schedule": {"kind": "zbv"}, "costs": {"head": {"forward": 5.3, "backward_input": 17.8}}}}
    )
    assert topology.pipeline.costs == PipelineCosts(head=WorkCost(forward=5.3, backward_input=17.8))
    memory = RankTopology.model_validate(
        {"pipeline": {"schedule": {"kind": "zbv", "activation_memory": 1.5}, "measure_costs_at_step": 2}}
    )
    assert memory.pipeline.schedule == ZeroBubbleVConfig(activation_memory=1.5)
    assert memory.pipeline.measure_costs_at_step == 2
    with pytest.raises(ValidationError, match=r"pipeline.costs.head.backward\n.*Extra inputs"):
        RankTopology.model_validate({"pipeline": {"costs": {"head": {"backward": 1}}}})


@pytest.mark.parametrize("kind", ["1f1b", "interleaved_1f1b", "dualpipe_v"])
def test_fixed_order_schedules_ignore_the_cost_model(kind):
    # Their orders are written out phase by phase (design note 0027): a cost model only changes which split to pick.
    config = PipelineConfig.model_validate({"schedule": {"kind": kind}})
    plain = plan_pipeline(config, pp=4, num_layers=32, num_microbatches=16).program(16)
    costed = plan_pipeline(
        config.model_copy(update={"costs": MEASURED}), pp=4, num_layers=32, num_microbatches=16
    ).program(16)
    assert costed.ranks == plain.ranks
