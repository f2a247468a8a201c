"""Programs without ranks: every builder validates at several sizes, simulated bubbles match the closed forms where
they exist, and the validator rejects broken programs with a message naming the rank, the action and the reason."""

from functools import partial

import pytest
import torch

from d9d.pipeline import PipelineConfig, plan_pipeline
from d9d.pipeline.config import DualPipeVConfig, Interleaved1F1BConfig, OneFOneBConfig, ZeroBubbleVConfig
from d9d.pipeline.program import (
    Action,
    ActionCosts,
    ActionKind,
    Placement,
    Program,
    ProgramError,
    StageLayout,
    build_program,
    dual_pipe_v,
    gpipe,
    inference,
    interleaved_one_f_one_b,
    one_f_one_b,
    replay,
    validate_program,
    zero_bubble_h1,
    zero_bubble_v,
)
from d9d.pipeline.program.communication import insert_communication
from d9d.pipeline.runtime.executor import check_channel_groups

BUILDERS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": partial(interleaved_one_f_one_b, v=2),
    "interleaved_1f1b_v3": partial(interleaved_one_f_one_b, v=3),
    "zb_h1": zero_bubble_h1,
    "zbv": zero_bubble_v,
    "dualpipe_v": dual_pipe_v,
}


def _sizes(name: str):
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 5, 8, 16, 24):
            if name.startswith("interleaved") and m % p:
                continue
            if name == "dualpipe_v" and m < 2 * p:
                continue
            yield p, m


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_schedule_builds_a_valid_program(name):
    for p, m in _sizes(name):
        program = build_program(name, partial(BUILDERS[name], p, m), m)
        computes = [action for actions in program.ranks.values() for action in actions if action.kind.is_compute]
        stages = program.layout.num_stages
        assert sum(action.kind is ActionKind.FORWARD for action in computes) == stages * m


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 16), (2, 8), (8, 16)])
def test_simulated_bubbles_match_closed_forms(p, m):
    def bubble(builder) -> float:
        return replay(build_program("x", builder, m)).bubble_fraction

    assert bubble(partial(gpipe, p, m)) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble(partial(one_f_one_b, p, m)) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble(partial(interleaved_one_f_one_b, p, m, 2)) == pytest.approx((p - 1) / (2 * m + p - 1))
    one_f_one_b_bubble = bubble(partial(one_f_one_b, p, m))
    assert bubble(partial(zero_bubble_h1, p, m)) < one_f_one_b_bubble
    if p <= 4:  # the ZB paper's (p-1)(F+I-W) per rank; at p=8 the greedy under 1F1B's memory stays above it
        assert bubble(partial(zero_bubble_h1, p, m)) == pytest.approx((p - 1) / (3 * m + p - 1))
    if m >= 2 * p:
        interleaved = bubble(partial(interleaved_one_f_one_b, p, m, 2))
        assert bubble(partial(zero_bubble_v, p, m)) < interleaved / 2
        assert bubble(partial(dual_pipe_v, p, m)) < interleaved / 2


def test_forward_only_program_on_a_v_layout():
    layout = StageLayout(3, 2, Placement.V)
    program = build_program("inference", lambda: inference(layout, 4), 4, training=False)
    assert all(
        action.kind in (ActionKind.FORWARD, ActionKind.SEND_ACTIVATION, ActionKind.RECV_ACTIVATION)
        for actions in program.ranks.values()
        for action in actions
    )


def test_text_form():
    assert str(Action(2, ActionKind.FORWARD, 5)) == "2F5"
    assert str(Action(2, ActionKind.SEND_ACTIVATION, 5)) == "2>F5"
    assert str(Action(3, ActionKind.RECV_GRADIENT, 1)) == "3<B1"


# Planted bugs -----------------------------------------------------------------------------------------------------


def _one_f_one_b(p: int = 2, m: int = 4) -> Program:
    return build_program("1f1b", partial(one_f_one_b, p, m), m)


def _edited(program: Program, rank: int, actions: list[Action]) -> Program:
    ranks = dict(program.ranks)
    ranks[rank] = tuple(actions)
    return Program(program.name, program.layout, program.num_microbatches, ranks, program.training)


def test_validator_rejects_a_missing_receive():
    program = _one_f_one_b()
    actions = [a for a in program.ranks[1] if a != Action(1, ActionKind.RECV_ACTIVATION, 2)]
    with pytest.raises(ProgramError, match=r"rank 1, action 1F2 .*no receive of it precedes"):
        validate_program(_edited(program, 1, actions))


def test_validator_rejects_a_duplicated_backward():
    program = _one_f_one_b()
    actions = [*program.ranks[0], Action(0, ActionKind.BACKWARD, 1)]
    with pytest.raises(ProgramError, match=r"rank 0, action 0B1 .*duplicated"):
        validate_program(_edited(program, 0, actions))


def test_validator_rejects_a_weight_gradient_next_to_a_full_backward():
    program = _one_f_one_b()
    actions = [*program.ranks[0], Action(0, ActionKind.BACKWARD_WEIGHT, 0)]
    with pytest.raises(ProgramError, match=r"0W0 .*(weight gradient needs|duplicated)"):
        validate_program(_edited(program, 0, actions))


def test_validator_rejects_a_missing_weight_gradient():
    program = build_program("zb_h1", partial(zero_bubble_h1, 2, 4), 4)
    actions = [a for a in program.ranks[1] if a != Action(1, ActionKind.BACKWARD_WEIGHT, 3)]
    with pytest.raises(ProgramError, match=r"stage 1, micro-batch 3 never gets its weight gradient \(W\)"):
        validate_program(_edited(program, 1, actions))


def test_validator_rejects_receives_out_of_channel_order():
    program = _one_f_one_b()
    actions = list(program.ranks[1])
    first, second = (
        actions.index(Action(1, ActionKind.RECV_ACTIVATION, 0)),
        actions.index(Action(1, ActionKind.RECV_ACTIVATION, 1)),
    )
    actions[first], actions[second] = actions[second], actions[first]
    with pytest.raises(
        ProgramError, match=r"channel rank 0 -> rank 1: message #0 is 0>F0 but receive #0 is 1<F1 .*in issue order"
    ):
        validate_program(_edited(program, 1, actions))


def test_validator_rejects_a_channel_carrying_activations_and_gradients_out_of_order():
    """ZBV, pp=2: rank 0 -> rank 1 carries stage 0's activations and stage 3's input gradients (the V's two arms).
    Rank 1 posts the receive of the first gradient before the activation receive that precedes it on the channel:
    message `k` would land in a buffer of the wrong kind and shape."""
    program = build_program("zbv", partial(zero_bubble_v, 2, 4), 4)
    sends = [a for a in program.ranks[0] if a.kind.is_send and program.layout.rank_of(a.peer_stage()) == 1]
    gradient = next(i for i, a in enumerate(sends) if a.kind is ActionKind.SEND_GRADIENT)
    assert gradient > 0 and sends[gradient - 1].kind is ActionKind.SEND_ACTIVATION
    activation_recv = Action(1, ActionKind.RECV_ACTIVATION, sends[gradient - 1].microbatch)
    gradient_recv = Action(2, ActionKind.RECV_GRADIENT, sends[gradient].microbatch)
    actions = list(program.ranks[1])
    actions.remove(gradient_recv)
    actions.insert(actions.index(activation_recv), gradient_recv)
    with pytest.raises(
        ProgramError,
        match=rf"channel rank 0 -> rank 1: message #{gradient - 1} is {sends[gradient - 1]} but receive "
        rf"#{gradient - 1} is {gradient_recv}",
    ):
        validate_program(_edited(program, 1, actions))


def test_validator_reports_a_deadlock_with_every_blocked_rank():
    program = _one_f_one_b(2, 2)
    # Both channels carry micro-batch 0, then rank 0 waits for micro-batch 1's gradient before it sends the
    # activation that produces it.
    actions = [
        Action(0, ActionKind.FORWARD, 0),
        Action(0, ActionKind.SEND_ACTIVATION, 0),
        Action(0, ActionKind.RECV_GRADIENT, 0),
        Action(0, ActionKind.BACKWARD, 0),
        Action(0, ActionKind.FORWARD, 1),
        Action(0, ActionKind.RECV_GRADIENT, 1),
        Action(0, ActionKind.BACKWARD, 1),
        Action(0, ActionKind.SEND_ACTIVATION, 1),
    ]
    with pytest.raises(
        ProgramError,
        match=r"deadlock: rank 0 waits at 0B1 for the input gradient of stage 1 for micro-batch 1 from rank 1; "
        r"rank 1 waits at 1F1 for the activation of stage 0 for micro-batch 1 from rank 0",
    ):
        validate_program(_edited(program, 0, actions))


def test_validator_rejects_a_stage_on_the_wrong_rank_and_an_incomplete_program():
    program = _one_f_one_b()
    with pytest.raises(ProgramError, match="stage 1 lives on rank 1"):
        validate_program(_edited(program, 0, [Action(1, ActionKind.FORWARD, 0)]))
    with pytest.raises(ProgramError, match=r"rank 0, action 1<F0: stage 1 lives on rank 1"):
        validate_program(_edited(program, 0, [*program.ranks[0], Action(1, ActionKind.RECV_ACTIVATION, 0)]))
    with pytest.raises(ProgramError, match=r"rank 1, action 1>F0: stage 2 \(its other end\) is outside the 2 stages"):
        validate_program(_edited(program, 1, [*program.ranks[1], Action(1, ActionKind.SEND_ACTIVATION, 0)]))
    cut = [a for a in program.ranks[0] if a.microbatch != 3] + [
        a for a in program.ranks[0] if a.microbatch == 3 and a.kind is ActionKind.FORWARD
    ]
    with pytest.raises(
        ProgramError,
        match=r"rank 1 waits at 1F3 for the activation of stage 0 for micro-batch 3 from rank 0 "
        r"\(which finished without sending it\)",
    ):
        validate_program(_edited(program, 0, cut))


# Plans: errors before any rank starts -----------------------------------------------------------------------------


def test_plan_errors_name_the_values():
    with pytest.raises(
        ValueError, match=r"dualpipe_v needs at least 2\*pp=8 micro-batches .* num_microbatches=6 with pp=4"
    ):
        plan_pipeline(PipelineConfig(schedule=DualPipeVConfig()), pp=4, num_layers=8, num_microbatches=6)
    with pytest.raises(ValueError, match=r"multiple of pp, got num_microbatches=6 with pp=4"):
        plan_pipeline(PipelineConfig(schedule=Interleaved1F1BConfig()), pp=4, num_layers=8, num_microbatches=6)
    with pytest.raises(
        ValueError, match=r"num_layers=6 \(\+0 virtual\) cannot fill 8 stages \(pp=4 x 2 stages per rank for zbv\)"
    ):
        plan_pipeline(PipelineConfig(schedule=ZeroBubbleVConfig()), pp=4, num_layers=6, num_microbatches=8)
    with pytest.raises(ValueError, match=r"num_layers=7 .* 8 layer slots, not divisible by 3 stages"):
        plan_pipeline(
            PipelineConfig(schedule=OneFOneBConfig(), virtual_layers_pre=1, even_split=True),
            pp=3,
            num_layers=7,
            num_microbatches=4,
        )
    # FSDP follows a split backward (its reduction deferred past the last W, runtime/fsdp_reduction.py)
    plan_pipeline(PipelineConfig(schedule=ZeroBubbleVConfig()), pp=2, num_layers=8, num_microbatches=4, dp_shard=2)


def test_config_rejects_unknown_schedules_and_keys():
    with pytest.raises(ValueError, match="kind"):
        PipelineConfig.model_validate({"schedule": {"kind": "looped_bfs"}})
    with pytest.raises(ValueError, match="extra"):
        PipelineConfig.model_validate({"schedule": {"kind": "1f1b"}, "stages": 3})
    config = PipelineConfig.model_validate({"schedule": {"kind": "interleaved_1f1b", "stages_per_rank": 3}})
    plan = plan_pipeline(config, pp=2, num_layers=12, num_microbatches=4)
    assert [stage.index for stage in plan.stages_of(1)] == [1, 3, 5]
    assert list(plan.stage(5).layers(12)) == [10, 11]


def test_validator_accepts_the_two_directions_of_a_pair_in_different_orders():
    """Rank 1 posts the receive of micro-batch 1's activation after sending micro-batch 0's gradient, while rank 0
    sends that activation before receiving the gradient. Each direction is its own channel with its own communicator
    (design note 0026), so only each channel's order matters: valid (a single NCCL communicator per pair needed one
    common order here, which the validator checked before 0.5.0)."""
    program = _one_f_one_b(2, 2)
    actions = list(program.ranks[1])
    recv, send = Action(1, ActionKind.RECV_ACTIVATION, 1), Action(1, ActionKind.SEND_GRADIENT, 0)
    actions.remove(recv)
    actions.insert(actions.index(send) + 1, recv)
    validate_program(_edited(program, 1, actions))


def test_validator_rejects_channels_opened_in_crossed_orders():
    """Rank 0 posts the gradient receive (channel 1 -> 0) before its first send (channel 0 -> 1), while rank 1 first
    receives on 0 -> 1 and sends on 1 -> 0 only at the end. Posted receives never block, so this would run on gloo,
    but NCCL creates each channel's communicator on its first operation, with both ends blocking until the other
    arrives: rank 0 waits in 1 -> 0 for rank 1, which waits in 0 -> 1 for rank 0."""
    program = _one_f_one_b(2, 1)
    actions = [
        Action(0, ActionKind.FORWARD, 0),
        Action(0, ActionKind.RECV_GRADIENT, 0),
        Action(0, ActionKind.SEND_ACTIVATION, 0),
        Action(0, ActionKind.BACKWARD, 0),
    ]
    with pytest.raises(
        ProgramError,
        match=r"deadlock: rank 0 waits at 0<B0 for rank 1 to reach its first operation on channel rank 1 -> rank 0 .*"
        r"rank 1 waits at 1<F0 for rank 0 to reach its first operation on channel rank 0 -> rank 1",
    ):
        validate_program(_edited(program, 0, actions))


def test_one_group_for_both_directions_is_refused_on_nccl_only():
    """Programs order each channel on its own; NCCL on one group would run a pair's two channels on one stream."""
    check_channel_groups("gloo", torch.device("cpu"), separate=False)
    check_channel_groups("cpu:gloo,cuda:nccl", torch.device("cpu"), separate=False)
    check_channel_groups("nccl", torch.device("cuda", 0), separate=True)
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        message = rf"upstream_group=None .*backend '{backend}' on device cuda:0: NCCL needs"
        with pytest.raises(ValueError, match=message):
            check_channel_groups(backend, torch.device("cuda", 0), separate=False)


def test_stage_weights_charge_each_stage_its_share():
    """Equal weights (any scale) replay exactly as uniform costs; a heavier stage bounds the step from below by its
    own work (m forwards and m full backwards), and a V schedule sees its first and last stage share rank 0."""
    p, m = 4, 16
    program = build_program("1f1b", partial(one_f_one_b, p, m), m)
    uniform = replay(program)
    scaled = replay(program, ActionCosts(stage_weights=(5.0,) * p))
    assert scaled.makespan == pytest.approx(uniform.makespan)
    assert scaled.bubble_fraction == pytest.approx(uniform.bubble_fraction)

    heavy_last = (1.0, 1.0, 1.0, 3.0)  # normalised to mean 1: the last stage costs 2x a uniform one
    timeline = replay(program, ActionCosts(stage_weights=heavy_last))
    share = 3.0 * len(heavy_last) / sum(heavy_last)
    assert timeline.busy(p - 1) == pytest.approx(m * 3.0 * share)  # forward 1 + full backward 2, per micro-batch
    assert timeline.makespan >= m * 3.0 * share
    assert timeline.bubble_fraction > uniform.bubble_fraction

    # ZBV puts stages 0 and 2p-1 on rank 0: a heavy head there costs more than on 1F1B's last rank alone.
    zbv = build_program("zbv", partial(zero_bubble_v, p, m), m)
    head = tuple(4.0 + (6.0 if stage == 2 * p - 1 else 0.0) for stage in range(2 * p))
    balanced = (2.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 6.0)  # the same total, rank 0 no heavier than the others
    assert sum(head) == sum(balanced)
    assert replay(zbv, ActionCosts(stage_weights=balanced)).bubble_fraction < (
        replay(zbv, ActionCosts(stage_weights=head)).bubble_fraction
    )


def test_stage_weights_must_match_the_stages():
    program = build_program("1f1b", partial(one_f_one_b, 2, 4), 4)
    with pytest.raises(ValueError, match=r"stage_weights=\(1.0, 2.0, 3.0\) must give each of the 2 stages"):
        replay(program, ActionCosts(stage_weights=(1.0, 2.0, 3.0)))
    with pytest.raises(ValueError, match="non-negative"):
        replay(program, ActionCosts(stage_weights=(1.0, -1.0)))


def test_the_first_stages_gradient_is_waited_for_by_its_weight_pass_only():
    # pp=2, a stage per rank, unit costs and a latency of 5 per message. Rank 0 runs F(0,0), I(0,0), F(0,1), W(0,0):
    # the gradient of micro-batch 0 arrives at 13 (F(0,0) ends at 1, the activation lands at 6, F(1,0) and I(1,0)
    # end at 8, the gradient lands at 13). The first stage's I computes nothing (the executor runs its whole
    # backward in W), so F(0,1) must not wait for that gradient; W(0,0) must, and costs both halves.
    layout = StageLayout(2, 1, Placement.LOOP)
    f, i, w = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
    compute = {
        0: [Action(0, kind, mb) for kind, mb in ((f, 0), (i, 0), (f, 1), (w, 0), (i, 1), (w, 1))],
        1: [Action(1, kind, mb) for kind, mb in ((f, 0), (i, 0), (w, 0), (f, 1), (i, 1), (w, 1))],
    }
    program = Program("first stage", layout, 2, insert_communication(layout, compute), training=True)
    validate_program(program)
    timeline = replay(program, ActionCosts(latency=5.0))
    starts = {timed.action: (timed.start, timed.end) for timed in timeline.ranks[0]}
    assert starts[Action(0, ActionKind.BACKWARD_INPUT, 0)] == (1.0, 1.0)
    assert starts[Action(0, ActionKind.FORWARD, 1)] == (1.0, 2.0)
    assert starts[Action(0, ActionKind.BACKWARD_WEIGHT, 0)] == (13.0, 15.0)
