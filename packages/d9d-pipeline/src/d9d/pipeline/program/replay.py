"""Replay a program without a process group: the semantics the executor honours, with simulated time.

Sends and receives are posted without blocking; a compute waits until its inputs exist (a local predecessor's
result or an arrived message); message `k` of a (sender, receiver) channel pairs with receive `k` of that channel.
The first operation of a channel waits until the other end reaches its first operation on it too: the executor gives
each channel its own NCCL communicator, which is created on the first message by both ends together (a host-side
rendezvous). That wait only orders the replay; it does not move simulated time, since communicators outlive a step.
The replay is the validator's proof (it raises `ProgramError` on a deadlock, a mispaired message, a duplicated or
missing computation) and the simulator's timeline (per-action start and end times from `ActionCosts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from d9d.pipeline.program.actions import Action, ActionKind, Program
from d9d.pipeline.program.communication import MessageKey, message_key


class ProgramError(ValueError):
    """A program that cannot run correctly; the message names the rank, the action and the reason."""


@dataclass(frozen=True)
class StageCost:
    """What one global stage's actions cost on one micro-batch: forward, input gradient and weight gradient (a full
    backward costs `backward_input + backward_weight`). Any time unit; the bench uses decoder-layer forwards."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):  # also rejects NaN
                raise ValueError(f"StageCost.{name}={value} must be a finite non-negative duration")

    def of_action(self, action: Action) -> float:
        """The duration of compute `action` of this stage. The first stage has no input gradient to compute: the
        executor runs nothing in its `I` and the whole backward in its `W`, so its `I` costs nothing and its `W`
        costs both halves."""
        if action.stage == 0 and action.kind is ActionKind.BACKWARD_INPUT:
            return 0.0
        if action.stage == 0 and action.kind is ActionKind.BACKWARD_WEIGHT:
            return self.backward_input + self.backward_weight
        return self.of(action.kind)

    def of(self, kind: ActionKind) -> float:
        """The duration of a compute action of `kind` (0 for communication)."""
        match kind:
            case ActionKind.FORWARD:
                return self.forward
            case ActionKind.BACKWARD:
                return self.backward_input + self.backward_weight
            case ActionKind.BACKWARD_INPUT:
                return self.backward_input
            case ActionKind.BACKWARD_WEIGHT:
                return self.backward_weight
            case _:
                return 0.0


@dataclass(frozen=True)
class ActionCosts:
    """Durations of one stage's work on one micro-batch, for a whole rank's share of the model (a rank holding `v`
    stages spends `cost / v` per stage action). Full backward = input + weight gradient.

    `stage_costs` instead gives every global stage its own forward, input-gradient and weight-gradient duration
    (absolute: not divided by the stages per rank, not scaled); it replaces `forward`, `backward_*` and
    `stage_weights`, which then must keep their defaults."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0  # from a send to the arrival at a posted receive
    # Relative cost of each global stage's actions (e.g. its layers, plus what the embedding and the head cost in
    # layers), scaled to a mean of 1 so the total work stays that of equal stages; None: every stage the same.
    stage_weights: tuple[float, ...] | None = None
    stage_costs: tuple[StageCost, ...] | None = None

    def __post_init__(self) -> None:
        if self.stage_costs is None:
            return
        if self.stage_weights is not None or (self.forward, self.backward_input, self.backward_weight) != (1, 1, 1):
            raise ValueError(
                "ActionCosts.stage_costs gives every stage its own forward/backward_input/backward_weight; leave "
                f"stage_weights (got {self.stage_weights}) and forward/backward_input/backward_weight (got "
                f"{self.forward}/{self.backward_input}/{self.backward_weight}) at their defaults"
            )
        if not self.stage_costs:
            raise ValueError("ActionCosts.stage_costs=() must name one StageCost per global stage")

    def weight_of(self, stage: int) -> float:
        if self.stage_weights is None:
            return 1.0
        return self.stage_weights[stage] * len(self.stage_weights) / sum(self.stage_weights)

    def check_stages(self, num_stages: int) -> None:
        """Raise `ValueError` naming the values unless the per-stage fields fit `num_stages` global stages."""
        weights = self.stage_weights
        if weights is not None and (len(weights) != num_stages or min(weights) < 0 or sum(weights) <= 0):
            raise ValueError(
                f"ActionCosts.stage_weights={weights} must give each of the {num_stages} stages a "
                "non-negative weight, not all zero"
            )
        if self.stage_costs is not None and len(self.stage_costs) != num_stages:
            raise ValueError(
                f"ActionCosts.stage_costs has {len(self.stage_costs)} entries; the program has {num_stages} global "
                "stages, one StageCost each"
            )

    def of(self, action: Action, stages_per_rank: int) -> float:
        """The simulated duration of compute `action` on a rank holding `stages_per_rank` stages."""
        if self.stage_costs is not None:
            return self.stage_costs[action.stage].of_action(action)
        uniform = StageCost(self.forward, self.backward_input, self.backward_weight)
        return uniform.of_action(action) / stages_per_rank * self.weight_of(action.stage)


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """Per-rank compute intervals of one replayed step."""

    program: Program
    ranks: dict[int, list[TimedAction]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max((items[-1].end for items in self.ranks.values() if items), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(item.end - item.start for item in self.ranks[rank])

    @property
    def bubble_fraction(self) -> float:
        """Idle time over (ranks x makespan)."""
        total = self.makespan * len(self.ranks)
        return 0.0 if total == 0 else 1.0 - sum(self.busy(rank) for rank in self.ranks) / total


@dataclass
class _Channel:
    sent: list[tuple[MessageKey, float]] = field(default_factory=list)  # key, time the send was posted
    posted: list[tuple[MessageKey, float, Action]] = field(default_factory=list)  # key, post time, receive


class _Replay:
    def __init__(self, program: Program, costs: ActionCosts) -> None:
        self.program, self.costs, self.layout = program, costs, program.layout
        costs.check_stages(self.layout.num_stages)
        self.pc = dict.fromkeys(program.ranks, 0)
        self.clock = dict.fromkeys(program.ranks, 0.0)
        self.done: dict[Action, float] = {}  # compute action -> end time
        self.channels: dict[tuple[int, int], _Channel] = {}
        self.posted: dict[tuple[int, MessageKey], tuple[int, int]] = {}  # (rank, key) -> (source, index)
        self.arrived: dict[tuple[int, int], set[int]] = {}  # channel -> ranks at (or past) their first operation on it
        self.used: set[tuple[int, tuple[int, int]]] = {  # (rank, channel) where the rank has an operation on it
            (rank, self.channel_of(rank, action))
            for rank, actions in program.ranks.items()
            for action in actions
            if action.kind.is_send or action.kind.is_recv
        }
        self.timeline = Timeline(program, {rank: [] for rank in program.ranks})

    def fail(self, rank: int, action: Action, reason: str) -> ProgramError:
        return ProgramError(f"{self.program.name}: rank {rank}, action {action} (#{self.pc[rank]}): {reason}")

    def run(self) -> Timeline:
        unfinished = {rank for rank, actions in self.program.ranks.items() if actions}
        while unfinished:
            progressed = False
            for rank in sorted(unfinished):
                while self.pc[rank] < len(self.program.ranks[rank]) and self.step(rank):
                    progressed = True
                    self.pc[rank] += 1
                if self.pc[rank] == len(self.program.ranks[rank]):
                    unfinished.discard(rank)
            if not progressed and unfinished:
                blocked = "; ".join(
                    f"rank {rank} waits at {self.program.ranks[rank][self.pc[rank]]} for {self.waiting_for(rank)}"
                    for rank in sorted(unfinished)
                )
                raise ProgramError(f"{self.program.name}: deadlock: {blocked}")
        self.check_complete()
        return self.timeline

    # One action ---------------------------------------------------------------------------------------------------

    def step(self, rank: int) -> bool:
        action = self.program.ranks[rank][self.pc[rank]]
        if self.layout.rank_of(action.stage) != rank:
            raise self.fail(rank, action, f"stage {action.stage} lives on rank {self.layout.rank_of(action.stage)}")
        if (action.kind.is_recv or action.kind.is_send) and not self.channel_open(rank, action):
            return False
        if action.kind.is_recv:
            self.post_receive(rank, action)
            return True
        if action.kind.is_send:
            self.post_send(rank, action)
            return True
        ready = self.inputs_ready(rank, action)
        if ready is None:
            return False
        self.check_not_duplicated(rank, action)
        start = max(self.clock[rank], ready)
        end = start + self.costs.of(action, self.layout.stages_per_rank)
        self.clock[rank] = end
        self.done[action] = end
        self.timeline.ranks[rank].append(TimedAction(action, start, end))
        return True

    def channel_of(self, rank: int, action: Action) -> tuple[int, int]:
        """(sender rank, receiver rank) of send or receive `action` on `rank`."""
        peer = self.layout.rank_of(action.peer_stage())
        return (rank, peer) if action.kind.is_send else (peer, rank)

    def channel_open(self, rank: int, action: Action) -> bool:
        """Whether `action`'s channel is open: both ends have reached an operation on it (a channel only one end uses
        is left to `check_complete`, which names the lost message)."""
        channel = self.channel_of(rank, action)
        arrived = self.arrived.setdefault(channel, set())
        arrived.add(rank)
        peer = channel[0] if channel[1] == rank else channel[1]
        return peer in arrived or (peer, channel) not in self.used

    def post_receive(self, rank: int, action: Action) -> None:
        key = message_key(action)
        source = self.layout.rank_of(action.peer_stage())
        channel = self.channels.setdefault((source, rank), _Channel())
        index = len(channel.posted)
        if index < len(channel.sent) and channel.sent[index][0] != key:
            raise self.fail(
                rank, action, f"receive #{index} from rank {source} would get message {channel.sent[index][0]}"
            )
        channel.posted.append((key, self.clock[rank], action))
        self.posted[(rank, key)] = (source, index)

    def post_send(self, rank: int, action: Action) -> None:
        producer = _producer_of(action)
        if producer not in self.done and _full_backward(producer) not in self.done:
            raise self.fail(rank, action, f"sends the result of {producer}, which has not run before it on this rank")
        key = message_key(action)
        target = self.layout.rank_of(action.peer_stage())
        channel = self.channels.setdefault((rank, target), _Channel())
        index = len(channel.sent)
        if any(sent_key == key for sent_key, _ in channel.sent):
            raise self.fail(rank, action, "sends the same message twice")
        if index < len(channel.posted) and channel.posted[index][0] != key:
            raise self.fail(rank, action, f"message #{index} to rank {target} would land in {channel.posted[index][2]}")
        channel.sent.append((key, self.clock[rank]))

    def inputs_ready(self, rank: int, action: Action) -> float | None:
        """When every input of compute `action` is there; None while one is still on its way."""
        ready = 0.0
        for needed in _dependencies(action, self.layout.last_stage):
            dependency = needed
            if needed.kind is ActionKind.BACKWARD_INPUT and needed not in self.done:
                full = _full_backward(needed)
                own_input = action.kind is ActionKind.BACKWARD_WEIGHT and needed.stage == action.stage
                if full in self.done and not own_input:  # a W needs its own I; a gradient may come from a B
                    dependency = full
            owner = self.layout.rank_of(dependency.stage)
            if owner == rank and dependency in self.done:
                ready = max(ready, self.done[dependency])
                continue
            if owner == rank:
                if action.kind is ActionKind.BACKWARD_WEIGHT:
                    raise self.fail(rank, action, f"the weight gradient needs {dependency} to run before it")
                if dependency.kind is ActionKind.FORWARD and action.kind is not ActionKind.FORWARD:
                    raise self.fail(rank, action, f"backward before its forward {dependency}")
                raise self.fail(rank, action, f"needs {dependency}, which comes later on this rank (or never)")
            # A remote producer: through a posted receive.
            key = _message_for(dependency)
            posted = self.posted.get((rank, key))
            if posted is None:
                raise self.fail(
                    rank,
                    action,
                    f"needs {_describe_message(key)} from rank {owner}, but no receive of it precedes this action",
                )
            source, index = posted
            channel = self.channels[(source, rank)]
            if index >= len(channel.sent):
                return None
            post_time = channel.posted[index][1]
            ready = max(ready, channel.sent[index][1] + self.costs.latency, post_time)
        return ready

    def check_not_duplicated(self, rank: int, action: Action) -> None:
        if action in self.done:
            raise self.fail(rank, action, "duplicated: this computation already ran")
        siblings = {
            ActionKind.BACKWARD: (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT),
            ActionKind.BACKWARD_INPUT: (ActionKind.BACKWARD,),
            ActionKind.BACKWARD_WEIGHT: (ActionKind.BACKWARD,),
        }.get(action.kind, ())
        for kind in siblings:
            other = Action(action.stage, kind, action.microbatch)
            if other in self.done:
                raise self.fail(rank, action, f"duplicated backward: {other} already computed this gradient")

    def waiting_for(self, rank: int) -> str:
        action = self.program.ranks[rank][self.pc[rank]]
        if action.kind.is_send or action.kind.is_recv:
            source, target = self.channel_of(rank, action)
            peer = target if source == rank else source
            return (
                f"rank {peer} to reach its first operation on channel rank {source} -> rank {target} (the channel's "
                "communicator is created on its first message, by both ends together)"
            )
        for dependency in _dependencies(action, self.layout.last_stage):
            owner = self.layout.rank_of(dependency.stage)
            if owner == rank:
                continue
            key = _message_for(dependency)
            source, index = self.posted[(rank, key)]
            if index < len(self.channels[(source, rank)].sent):
                continue
            finished = self.pc[owner] == len(self.program.ranks[owner])
            return f"{_describe_message(key)} from rank {owner}" + (
                " (which finished without sending it)" if finished else ""
            )
        return "nothing it can get"

    # The end ------------------------------------------------------------------------------------------------------

    def check_complete(self) -> None:
        name = self.program.name
        for (source, target), channel in sorted(self.channels.items()):
            if len(channel.sent) != len(channel.posted):
                extra = channel.sent[len(channel.posted) :] or channel.posted[len(channel.sent) :]
                what = (
                    "sent but never received" if len(channel.sent) > len(channel.posted) else "received but never sent"
                )
                raise ProgramError(f"{name}: rank {source} -> rank {target}: {_describe_message(extra[0][0])} {what}")
        for stage in range(self.layout.num_stages):
            for mb in range(self.program.num_microbatches):
                forward = Action(stage, ActionKind.FORWARD, mb)
                if forward not in self.done:
                    raise ProgramError(f"{name}: incomplete: micro-batch {mb} never goes forward through stage {stage}")
                if not self.program.training:
                    continue
                full = Action(stage, ActionKind.BACKWARD, mb) in self.done
                split_input = Action(stage, ActionKind.BACKWARD_INPUT, mb) in self.done
                split_weight = Action(stage, ActionKind.BACKWARD_WEIGHT, mb) in self.done
                if not (full or (split_input and split_weight)):
                    missing = "weight gradient (W)" if split_input else "backward"
                    raise ProgramError(f"{name}: incomplete: stage {stage}, micro-batch {mb} never gets its {missing}")
        if not self.program.training:
            backward = [action for action in self.done if action.kind is not ActionKind.FORWARD]
            if backward:
                raise ProgramError(f"{name}: a forward-only program runs {backward[0]}")


def _producer_of(send: Action) -> Action:
    if send.kind is ActionKind.SEND_ACTIVATION:
        return Action(send.stage, ActionKind.FORWARD, send.microbatch)
    return Action(send.stage, ActionKind.BACKWARD_INPUT, send.microbatch)


def _full_backward(action: Action) -> Action:
    return Action(action.stage, ActionKind.BACKWARD, action.microbatch)


def _dependencies(action: Action, last_stage: int) -> list[Action]:
    """Compute actions whose results `action` consumes. A gradient from stage s+1 is named by `I(s+1)`; a full
    `B(s+1)` satisfies it too. The first stage has no input gradient to compute: the executor's `I(0)` only marks
    the point after which its `W(0)` may run the whole backward, and `W(0)` is what takes stage 1's gradient."""
    s, mb = action.stage, action.microbatch
    gradient = [Action(s + 1, ActionKind.BACKWARD_INPUT, mb)] if s < last_stage else []
    match action.kind:
        case ActionKind.FORWARD:
            return [Action(s - 1, ActionKind.FORWARD, mb)] if s > 0 else []
        case ActionKind.BACKWARD_INPUT if s == 0:
            return [Action(s, ActionKind.FORWARD, mb)]
        case ActionKind.BACKWARD | ActionKind.BACKWARD_INPUT:
            return [Action(s, ActionKind.FORWARD, mb), *gradient]
        case ActionKind.BACKWARD_WEIGHT:
            return [Action(s, ActionKind.BACKWARD_INPUT, mb), *(gradient if s == 0 else [])]
        case _:
            return []


def _message_for(dependency: Action) -> MessageKey:
    direction = "F" if dependency.kind is ActionKind.FORWARD else "B"
    return direction, dependency.stage, dependency.microbatch


def _describe_message(key: MessageKey) -> str:
    direction, stage, mb = key
    what = "activation" if direction == "F" else "input gradient"
    return f"the {what} of stage {stage} for micro-batch {mb}"


def replay(program: Program, costs: ActionCosts | None = None) -> Timeline:
    """Replay `program` (raises `ProgramError` if it cannot run); the per-rank timeline under `costs`."""
    return _Replay(program, costs or ActionCosts()).run()
