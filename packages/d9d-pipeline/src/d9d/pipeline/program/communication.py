"""Insert sends and receives into per-rank compute orders.

A send goes right after the compute that produced its tensor. A receive goes before the compute that consumes it,
moved earlier only where needed so that on every channel (sender rank -> receiver rank) receives are posted in the
order of the sends: a channel's messages are matched in issue order, not by content. Nothing orders the operations
of different channels: the executor gives each channel its own communicator (design note 0026), so an operation
never waits behind one of another channel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from d9d.pipeline.program.actions import Action, ActionKind
from d9d.pipeline.program.layout import StageLayout

MessageKey = tuple[str, int, int]  # ("F" | "B", producing stage, micro-batch)


def message_key(action: Action) -> MessageKey:
    """The message a send carries or a receive expects, named by the stage that produced it."""
    match action.kind:
        case ActionKind.SEND_ACTIVATION | ActionKind.SEND_GRADIENT:
            producer = action.stage
        case ActionKind.RECV_ACTIVATION | ActionKind.RECV_GRADIENT:
            producer = action.peer_stage()
        case _:
            raise ValueError(f"{action} is not a communication action")
    direction = "F" if action.kind in (ActionKind.SEND_ACTIVATION, ActionKind.RECV_ACTIVATION) else "B"
    return direction, producer, action.microbatch


def needed_receives(layout: StageLayout, rank: int, action: Action) -> list[Action]:
    """Receives `action` on `rank` consumes (a tensor from a stage on another rank)."""
    match action.kind:
        case ActionKind.FORWARD if action.stage > 0 and layout.rank_of(action.stage - 1) != rank:
            return [Action(action.stage, ActionKind.RECV_ACTIVATION, action.microbatch)]
        # The first stage's gradient is read by its W, not its I; posting the receive before the I is early enough.
        case ActionKind.BACKWARD | ActionKind.BACKWARD_INPUT if (
            action.stage < layout.last_stage and layout.rank_of(action.stage + 1) != rank
        ):
            return [Action(action.stage, ActionKind.RECV_GRADIENT, action.microbatch)]
        case _:
            return []


def produced_sends(layout: StageLayout, rank: int, action: Action) -> list[Action]:
    """Sends of what `action` on `rank` produced for a stage on another rank."""
    match action.kind:
        case ActionKind.FORWARD if action.stage < layout.last_stage and layout.rank_of(action.stage + 1) != rank:
            return [Action(action.stage, ActionKind.SEND_ACTIVATION, action.microbatch)]
        case ActionKind.BACKWARD | ActionKind.BACKWARD_INPUT if (
            action.stage > 0 and layout.rank_of(action.stage - 1) != rank
        ):
            return [Action(action.stage, ActionKind.SEND_GRADIENT, action.microbatch)]
        case _:
            return []


def insert_communication(layout: StageLayout, compute: Mapping[int, Sequence[Action]]) -> dict[int, tuple[Action, ...]]:
    """Per-rank programs: `compute` with sends after producers and channel-ordered receives before consumers."""
    send_order: dict[MessageKey, int] = {}
    for rank, actions in compute.items():
        for action in actions:
            for send in produced_sends(layout, rank, action):
                send_order[message_key(send)] = len(send_order)
    programs: dict[int, tuple[Action, ...]] = {}
    for rank, actions in compute.items():
        # channel (source rank) -> [(send position, consumer index, receive)]
        channels: dict[int, list[tuple[float, int, Action]]] = {}
        for index, action in enumerate(actions):
            for recv in needed_receives(layout, rank, action):
                source = layout.rank_of(recv.peer_stage())
                order = send_order.get(message_key(recv), float("inf"))
                channels.setdefault(source, []).append((order, index, recv))
        placed: dict[int, list[tuple[int, float, Action]]] = {}
        for source, receives in channels.items():
            receives.sort(key=lambda item: item[0])
            position = len(actions)
            for order, index, recv in reversed(receives):  # post no later than the next one on this channel
                position = min(position, index)
                placed.setdefault(position, []).append((source, order, recv))
        program: list[Action] = []
        for index, action in enumerate(actions):
            program += [recv for _, _, recv in sorted(placed.get(index, []), key=lambda item: item[:2])]
            program.append(action)
            program += produced_sends(layout, rank, action)
        programs[rank] = tuple(program)
    return programs
